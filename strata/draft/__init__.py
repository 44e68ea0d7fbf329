"""Drafts: tokens proposed ahead of the model and verified by it in one window (speculative decoding).

`config` parses `--spec METHOD:K` into a `SpeculativeConfig` (vLLM's names: `method`, `num_speculative_tokens`);
`ngram` proposes the continuation of an earlier match of a sequence's last tokens in its own text. The slots
(`strata.runtime.slots`) put a drafting slot's last token and its drafts in a window as decode rows, one row each,
and keep the longest prefix the model agrees with (docs/BATCHING.md, drafts).
"""
