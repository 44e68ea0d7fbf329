"""Routed experts that do not all fit on a stage's device.

`residency`: which experts of each MoE layer stay on the device under the stage's `--expert-budget-gb`, and
the split of a layer's stacked experts into the resident part (on the device) and the rest (host RAM).
`pool`: the CPU expert pool, which computes the (row, expert) pairs whose expert is in host RAM.
`block`: the MoE block of a layer with a pool: routed on the device over every expert, resident pairs on the
device kernels, the others on the CPU, added together. See docs/EXPERTS.md.
"""
