"""Every Triton kernel against its torch reference on the GPU, in bfloat16, at a real model's sizes.

The CPU tests check the kernels under the Triton interpreter in float32 and float16 on small odd shapes; this
checks the compiled kernels on the card, in bfloat16, at Qwen3-30B-A3B / Qwen3-Next sizes: each line prints the
relative error (norm of the difference over the norm of the float32 reference) against a bound suited to
bfloat16, and "ok" or "FAIL". The fused decode kernel `qk_prep` also says how many of its elements differ from
the separate kernels it replaces (same arithmetic; the compiler may contract a multiply-add differently).

    python bench/kernels_check.py
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.nn.functional as F

from strata.kernels.attention import (attention, decode_attention_split_triton, decode_attention_triton,
                                      prefill_attention_triton)
from strata.kernels.elementwise import (gdn_gates, gdn_gates_triton, sigmoid_gate_add, sigmoid_gate_add_triton,
                                        silu_mul, silu_mul_triton)
from strata.kernels.gdn import (causal_conv1d, causal_conv1d_triton, gated_delta_rule_chunked,
                                gated_delta_rule_chunked_triton, gated_delta_rule_step, gdn_decode_triton)
from strata.kernels.linear import linear_triton
from strata.kernels.moe import (PROMPT_TILES, add_shared_expert, moe_triton, route, route_triton, routed_experts,
                                swiglu)
from strata.kernels.qk_prep import qk_prep_reference, qk_prep_triton
from strata.kernels.rmsnorm import add_rms_norm, add_rms_norm_triton, rms_norm, rms_norm_triton, rms_normalize
from strata.kernels.rope import apply_rope, apply_rope_triton, rope_cos_sin, rope_inv_freq
from strata.kernels.sampling import pick_triton, uniform_triton
from strata.runtime.sampling import SamplingParams, philox_uniform, sample

DEV, BF16 = "cuda", torch.bfloat16
BOUND = 2e-2  # relative error allowed for bfloat16 outputs against a float32 reference
failures: list[str] = []


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def report(name: str, err: float, bound: float = BOUND) -> None:
    ok = err <= bound
    if not ok:
        failures.append(name)
    print(f"{name:58} {err:10.2e}  (bound {bound:.0e})  {'ok' if ok else 'FAIL'}")


def rand(*shape, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


def check_linear() -> None:
    for m, n, k in [(1, 5120, 2048), (8, 2048, 4096), (64, 128, 2048), (3, 151936, 2048)]:
        x, w = rand(m, k), rand(n, k, scale=k**-0.5)
        report(f"linear_triton M={m} N={n} K={k}", rel(linear_triton(x, w), F.linear(x.float(), w.float())))


def check_norms_and_rope() -> None:
    x, res, w = rand(33, 2048), rand(33, 2048), torch.rand(2048, device=DEV) + 0.5
    report("rms_norm_triton [33, 2048]", rel(rms_norm_triton(x, w, 1e-6), rms_norm(x.float(), w, 1e-6)))
    want, want_res = add_rms_norm(x.float(), res.float(), w, 1e-6)
    for decode in (False, True):  # a decode window's norm runs on other warps (another sum order)
        got, got_res = add_rms_norm_triton(x, res, w, 1e-6, decode=decode)
        report(f"add_rms_norm_triton (normed, residual){' decode' if decode else ''}",
               max(rel(got, want), rel(got_res, want_res)))
    for d, rot in [(128, 128), (256, 64)]:
        q, pos = rand(17, 16, d), torch.arange(100, 117, device=DEV)
        inv = rope_inv_freq(rot, 1e6, DEV)
        want = apply_rope(q.float(), *rope_cos_sin(pos, inv, torch.float32))
        report(f"apply_rope_triton D={d} rotary={rot}", rel(apply_rope_triton(q, pos, inv, rot), want))


def check_qk_prep() -> None:
    """Against float32 norms + rotary (bound as every kernel), and against the separate Triton kernels: the same
    arithmetic, but the compiler may fuse a multiply-add differently in the fused kernel, so the count of elements
    that differ from the separate kernels (by one rounding at most) is printed too."""
    for h, hkv, d, rot, norm in [(32, 4, 128, 128, True), (16, 2, 256, 64, True), (32, 8, 64, 64, False)]:
        r = 9
        qkv = rand(r, (h + 2 * hkv) * d)
        q = qkv[:, : h * d].reshape(r, h, d)
        k = qkv[:, h * d : (h + hkv) * d].reshape(r, hkv, d)
        v = qkv[:, (h + hkv) * d :].reshape(r, hkv, d)
        norms = (torch.rand(d, device=DEV) + 0.5, torch.rand(d, device=DEV) + 0.5) if norm else (None, None)
        pos = torch.randint(0, 60, (r,), device=DEV, dtype=torch.int32)
        seq = torch.randperm(12, device=DEV)[:r].int()
        inv = rope_inv_freq(rot, 1e6, DEV)
        pools = [torch.zeros(12, 64, hkv, d, device=DEV, dtype=BF16) for _ in range(2)]
        sep_pools = [p.clone() for p in pools]
        got = qk_prep_triton(q, k, v, *norms, 1e-6, pos, inv, rot, *pools, seq)
        sep = qk_prep_reference(q, k, v, *norms, 1e-6, pos, inv, rot, *sep_pools, seq)
        qf, kf = q.float(), k.float()
        if norm:
            qf, kf = rms_normalize(qf, norms[0], 1e-6), rms_normalize(kf, norms[1], 1e-6)
        cos_sin = rope_cos_sin(pos.long(), inv, torch.float32)
        want_q, want_k = apply_rope(qf, *cos_sin), apply_rope(kf, *cos_sin)
        sl, ps = seq.long(), pos.long()
        err = max(rel(got, want_q), rel(pools[0][sl, ps], want_k), rel(pools[1][sl, ps], v.float()))
        differ = sum(int((a != b).sum()) for a, b in zip((got, *pools), (sep, *sep_pools)))
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip((got, *pools), (sep, *sep_pools)))
        report(f"qk_prep_triton H={h} Hkv={hkv} D={d} ({differ} elements differ from the separate kernels, "
               f"by {worst:.1e} at most)", err)


def check_moe() -> None:
    for e, k, i, shared in [(128, 8, 768, False), (512, 10, 512, True)]:
        h = 2048
        router, gate_up = rand(e, h, scale=h**-0.5), rand(e, 2 * i, h, scale=h**-0.5)
        down = rand(e, h, i, scale=i**-0.5)
        sh = (rand(2 * i, h, scale=h**-0.5), rand(h, i, scale=i**-0.5)) if shared else None
        sg = rand(1, h, scale=h**-0.5) if shared else None
        logits = torch.randn(64, e, device=DEV)
        weights, ids = route_triton(logits, k, True)
        ref_w, ref_ids = route(logits, torch.eye(e, device=DEV), k, True)
        ok = torch.equal(ids.long().sort(-1)[0], ref_ids.sort(-1)[0])
        report(f"route_triton E={e} top-{k} (same experts)", 0.0 if ok else 1.0, 0.0)
        for rows, tiles, name in [(1, None, "decode tiles"), (64, None, "decode tiles"), (2048, PROMPT_TILES, "prompt tiles")]:
            x = rand(rows, h)
            kw = {} if tiles is None else {"tiles": tiles}
            linear = linear_triton if tiles is None else F.linear
            got = moe_triton(x, router, gate_up, down, k, True, sh, sg, linear=linear, **kw)
            # The reference takes the experts the kernel's bf16 router logits chose: a float32 router would pick
            # another expert wherever two logits are closer than a bf16 rounding, which says nothing of the kernels.
            w_ref, ids_ref = route(linear(x, router).float(), torch.eye(e, device=DEV), k, True)
            want = routed_experts(x.float(), w_ref.float(), ids_ref, gate_up.float(), down.float())
            if sh is not None:
                want = add_shared_expert(want, x.float(), (sh[0].float(), sh[1].float()), sg.float(), swiglu, F.linear)
            report(f"moe_triton E={e} top-{k} R={rows} {name}", rel(got, want))


def check_elementwise() -> None:
    gu = rand(8, 2 * 768)
    report("silu_mul_triton [8, 2x768]", rel(silu_mul_triton(gu), silu_mul(gu.float())))
    out, sh, logit = rand(8, 2048), rand(8, 2048), rand(8, 1)
    report("sigmoid_gate_add_triton [8, 2048]",
           rel(sigmoid_gate_add_triton(out, sh, logit), sigmoid_gate_add(out.float(), sh.float(), logit.float())))
    a, b = rand(8, 32, scale=4.0), rand(8, 32, scale=4.0)
    neg_a, dt = -torch.rand(32, device=DEV) - 0.1, torch.randn(32, device=DEV)
    decay, beta = gdn_gates_triton(a, b, neg_a, dt)
    want_decay, want_beta = gdn_gates(a.float(), b.float(), neg_a, dt)
    report("gdn_gates_triton [8, 32] (decay, beta)", max(rel(decay, want_decay), rel(beta, want_beta)))


def check_attention() -> None:
    for h, hkv, d in [(32, 4, 128), (16, 2, 256)]:
        t = 1024
        q, kc, vc = rand(t, h, d), rand(t, hkv, d), rand(t, hkv, d)
        pos = torch.arange(t, device=DEV)
        want = attention(q.float(), kc.float(), vc.float(), pos, d**-0.5)
        report(f"prefill_attention_triton T={t} H={h} Hkv={hkv} D={d}", rel(prefill_attention_triton(q, kc, vc, pos, d**-0.5), want))
        r, cells = 8, 700
        kp, vp = rand(10, cells, hkv, d), rand(10, cells, hkv, d)
        qd = rand(r, h, d)
        seq = torch.randperm(10, device=DEV)[:r].int()
        pos = torch.randint(1, cells, (r,), device=DEV, dtype=torch.int32)

        def decode_want(kp, vp, pos):  # each row alone over its own cells, in float32
            return torch.cat([attention(qd[j : j + 1].float(), kp[seq[j], : pos[j] + 1].float(),
                                        vp[seq[j], : pos[j] + 1].float(), pos[j : j + 1].long(), d**-0.5)
                              for j in range(r)])

        got = decode_attention_triton(qd, kp, vp, seq, pos, d**-0.5)
        report(f"decode_attention_triton R={r} H={h} Hkv={hkv} D={d} up to {cells} cells", rel(got, decode_want(kp, vp, pos)))
        # the decode windows' kernel: cells in chunks, merged in the launch by the last chunk to finish (atomics)
        cells = 5000
        kp, vp = rand(10, cells, hkv, d), rand(10, cells, hkv, d)
        pos = torch.tensor([0, 511, 512, 1500, 2600, 3999, 4500, 4999], device=DEV, dtype=torch.int32)
        got = decode_attention_split_triton(qd, kp, vp, seq, pos, d**-0.5)
        want = decode_want(kp, vp, pos)
        again = [decode_attention_split_triton(qd, kp, vp, seq, pos, d**-0.5) for _ in range(20)]
        alike = all(torch.equal(a, got) for a in again)
        report(f"decode_attention_split_triton R={r} H={h} Hkv={hkv} D={d} up to {cells} cells "
               f"({'20 calls alike' if alike else 'calls DIFFER'})", rel(got, want) if alike else float("inf"))


def check_gdn() -> None:
    hk, hv, dk, dv, kk = 16, 32, 128, 128, 4
    c = 2 * hk * dk + hv * dv
    x, w, hist = rand(4096, c), rand(c, kk, scale=0.5), rand(kk - 1, c)
    got, got_h = causal_conv1d_triton(x, w, hist)
    want, want_h = causal_conv1d(x.float(), w.float(), hist.float())
    report("causal_conv1d_triton T=4096", max(rel(got, want), rel(got_h, want_h)))
    t = 4096
    q = F.normalize(torch.randn(t, hk, dk, device=DEV), dim=-1).to(BF16)
    k = F.normalize(torch.randn(t, hk, dk, device=DEV), dim=-1).to(BF16)
    v, decay = rand(t, hv, dv), -torch.rand(t, hv, device=DEV) * 0.5
    beta, state = torch.rand(t, hv, device=DEV).to(BF16), torch.randn(hv, dk, dv, device=DEV) * 0.1
    got, got_s = gated_delta_rule_chunked_triton(q, k, v, decay, beta, state)
    want, want_s = gated_delta_rule_chunked(q.float(), k.float(), v.float(), decay, beta.float(), state)
    report("gated_delta_rule_chunked_triton T=4096", max(rel(got, want), rel(got_s, want_s)))
    r, s = 6, 9
    mixed, conv_pool = rand(r, c), rand(s, kk - 1, c)
    rec_pool = torch.randn(s, hv, dk, dv, device=DEV) * 0.1
    seq = torch.randperm(s, device=DEV)[:r].int()
    dec, bet = -torch.rand(r, hv, device=DEV) * 0.5, torch.rand(r, hv, device=DEV).to(BF16)
    conv_ref, rec_ref = conv_pool.clone(), rec_pool.clone()
    got = gdn_decode_triton(mixed, w, conv_pool, rec_pool, seq, dec, bet, hk, hv, dk, dv)
    outs = []
    for j in range(r):
        i = int(seq[j])
        y, conv_ref[i] = causal_conv1d(mixed[j : j + 1].float(), w.float(), conv_ref[i].float())
        qj, kj, vj = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        o, rec_ref[i] = gated_delta_rule_step(qj.reshape(1, hk, dk), kj.reshape(1, hk, dk), vj.reshape(1, hv, dv),
                                             dec[j : j + 1], bet[j : j + 1].float(), rec_ref[i])
        outs.append(o)
    report(f"gdn_decode_triton R={r} (output, states)",
           max(rel(got, torch.cat(outs)), rel(rec_pool[seq.long()], rec_ref[seq.long()]),
               rel(conv_pool[seq.long()], conv_ref[seq.long()])))


def check_sampling() -> None:
    """The sampler on the device over a 151,936-token vocabulary: its uniform numbers against the torch generator
    (bitwise), its pick against float64 sums (a top-p cut between two tokens, positions whose number lands well
    inside a token's share, so the pick must be that rank exactly), 20 repeated calls bitwise alike (torch.cumsum
    on one long row was not), and the time of a pick and of a whole `sample` call."""
    rows, vocab = 64, 151936
    seeds = torch.randint(0, 2**62, (rows,))
    counters = torch.randint(0, 2**40, (rows,))
    report("uniform_triton vs philox_uniform: numbers that differ",
           float((uniform_triton(seeds.to(DEV), counters.to(DEV)).cpu() != philox_uniform(seeds, counters)).sum()), 0)
    logits = torch.randn(rows, vocab, device=DEV, dtype=torch.float64) * torch.linspace(2.0, 8.0, rows, device=DEV)[:, None]
    probs = logits.softmax(-1).sort(-1, descending=True).values.float()
    cum = probs.double().cumsum(-1).cpu()
    top_p, positions, want = [], [], []
    tries = torch.arange(200)
    for r in range(rows):
        wide = max(2, int((probs[r].double().cpu() > 1e-4).sum()))  # shares far above float32 rounding
        cut = min(wide, 200)
        top_p.append(float((cum[r, cut - 2] + cum[r, cut - 1]) / 2 / cum[r, -1]))  # keeps `cut` tokens
        bounds = torch.cat([torch.zeros(1, dtype=torch.float64), cum[r, :cut]]) / cum[r, cut - 1]
        u = philox_uniform(seeds[r].repeat(200), tries).double()
        j = torch.searchsorted(bounds[1:], u, right=True)
        margin = torch.minimum(u - bounds[j], bounds[j + 1] - u)
        first = int(torch.nonzero(margin > 1e-5)[0])
        positions.append(first)
        want.append(int(j[first]))
    top_k = torch.full((rows,), vocab, device=DEV)
    top_p, min_p = torch.tensor(top_p, device=DEV, dtype=torch.float32), torch.zeros(rows, device=DEV)
    seed, position = seeds.to(DEV), torch.tensor(positions, device=DEV)
    picks = [pick_triton(probs, top_k, top_p, min_p, seed, position) for _ in range(20)]
    report("pick_triton [64, 151936]: ranks off the float64 pick", float((picks[0].cpu() != torch.tensor(want)).sum()), 0)
    report("pick_triton: calls that differ from the first of 20", float(sum(not torch.equal(p, picks[0]) for p in picks)), 0)
    ones = torch.ones(rows, device=DEV)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1)] * rows
    timed = {"pick_triton, top_p 0.9": lambda n: pick_triton(probs[:n], top_k[:n], top_p[:n], min_p[:n], seed[:n],
                                                              position[:n]),
             "pick_triton, top_p 1 (the whole row, 3 times)": lambda n: pick_triton(
                 probs[:n], top_k[:n], ones[:n], min_p[:n], seed[:n], position[:n]),
             "sample(), temperature 0.8, top_p 0.9": lambda n: sample(logits[:n].float(), params[:n], list(range(n)))}
    # The picks: GPU time, 20 calls captured as one CUDA graph (the host launches slower than these kernels run).
    # sample() copies the rows' settings from the host (no capture): 20 calls as decode makes them, host pace included.
    for name, fn in timed.items():
        for n in (1, 64):
            fn(n)  # compiled and warmed first
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graphed = name.startswith("pick")
            if graphed:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        fn(n)
                start.record()
                graph.replay()
            else:
                start.record()
                for _ in range(20):
                    fn(n)
            end.record()
            torch.cuda.synchronize()
            how = "GPU time, graph replay" if graphed else "eager, host included"
            print(f"{name}, {n} row(s): {start.elapsed_time(end) / 20 * 1e3:.1f} us a call ({how})")


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16")
    for check in (check_linear, check_norms_and_rope, check_qk_prep, check_elementwise, check_moe, check_attention,
                  check_gdn, check_sampling):
        try:
            check()
        except Exception:  # noqa: BLE001 - one broken check must not hide the others
            failures.append(check.__name__)
            print(f"{check.__name__}: ERROR\n{traceback.format_exc(limit=3)}")
    print(f"\n{'all kernels within their bounds' if not failures else 'FAILED: ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
