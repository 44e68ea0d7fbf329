"""Train a multi-token-prediction (MTP) draft head for the embedded default model, SmolLM2-135M-Instruct.

The head has Qwen3-Next's MTP layout over the main model's sizes. For a token sequence x_0..x_{T-1} with the main
model's final hidden states Hs_t (after its final norm: what its LM head reads), row t (t = 0..T-2) takes
(Hs_t, x_{t+1}) and predicts x_{t+2}:

    e_t = rmsnorm(E[x_{t+1}]) * w_pre_e            mtp.pre_fc_norm_embedding.weight
    g_t = rmsnorm(Hs_t) * w_pre_h                  mtp.pre_fc_norm_hidden.weight
    z_t = fc([e_t ; g_t])                          mtp.fc.weight [H, 2H], embedding first
    one Llama decoder layer over the rows (causal, rotary at position t for row t, HF rotate_half convention)
    o_t = rmsnorm(out_t) * w_norm                  mtp.norm.weight
    logits_t = o_t @ E[draft_vocab]^T              E: the main model's (tied) embedding; mtp.draft_vocab

Chained drafting: step 1 is the row at the last position t; step j >= 2 is a row at position t+j-1 whose inputs
are (o of step j-1, the draft of step j-1); it attends to the real rows 0..t, the rows of steps 2..j-1, and itself.

Training is self-distillation: the main model answers generated chat prompts (greedy and sampled), and the targets
are the main model's own greedy picks at each position (plus its top-k probabilities as soft targets). The main
model is frozen; its hidden states are computed once, while the answers are generated, and cached on disk.

    python train/mtp_head.py                       # writes strata/model/heads/smollm2-135m-instruct-mtp.safetensors
    python train/mtp_head.py --device cuda --tokens 12000000 --gen-batch 1024 ...   # what ships (train/README.md)

On a GPU the answers are generated in batches of hundreds (float32, no TF32) and kept on the device for training;
`--gen-time-limit` and `--total-time-limit` bound the run. See train/README.md for the command that made the
shipped head, its measured acceptance and the time it takes."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# On cores shared with other work, OpenMP threads that spin while waiting make every matrix product many times
# slower (measured here: 0.2 s a decode step alone, 1-4 s with a busy neighbour); passive waiting avoids it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# transformers 5.2x renames LlamaModel's `past_key_values` to `cache`; the old name works across 5.x
warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated", category=FutureWarning)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "strata" / "model" / "heads" / "smollm2-135m-instruct-mtp.safetensors"
CACHE = Path.home() / ".cache" / "strata-train"
TOPK = 8  # teacher probabilities kept per position, for the soft part of the loss

# SmolLM2-135M-Instruct's sizes; the file's metadata carries them too ("config")
SMOLLM2 = dict(hidden=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate=1536,
               eps=9.999999747378752e-06, rope_theta=100000.0)


# ----------------------------------------------------------------------------------------------------------------
# The head


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: x / sqrt(mean(x^2) + eps) * weight (no 1 + w offset), computed in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's default rotary: inv_freq_i = theta^(-2i/d), angle = pos * inv_freq, both halves the same angles
    (cat(freqs, freqs)); applied as x * cos + rotate_half(x) * sin. Returns cos, sin of shape positions.shape + [d]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class MtpHead(nn.Module):
    """The draft head. `embedding` is the main model's token embedding E [V, H] (tied with its LM head); it is not
    trained and not saved. `draft_vocab` [N]: the token ids the head scores (sorted ascending)."""

    def __init__(self, embedding: torch.Tensor, draft_vocab: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate: int, eps: float, rope_theta: float, **_):
        super().__init__()
        hidden = embedding.shape[1]
        self.hidden, self.num_heads, self.num_kv_heads, self.head_dim = hidden, num_heads, num_kv_heads, head_dim
        self.intermediate, self.eps, self.rope_theta = intermediate, float(eps), float(rope_theta)
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        self.register_buffer("draft_vocab", torch.as_tensor(draft_vocab, dtype=torch.int64).sort().values)
        ones = lambda: nn.Parameter(torch.ones(hidden))  # noqa: E731
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = ones(), ones()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm, self.post_attention_layernorm, self.norm = ones(), ones(), ones()
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.to(embedding.device)

    # -- the file ---------------------------------------------------------------------------------------------

    FILE_NAMES = {
        "mtp.pre_fc_norm_embedding.weight": "pre_fc_norm_embedding",
        "mtp.pre_fc_norm_hidden.weight": "pre_fc_norm_hidden",
        "mtp.fc.weight": "fc.weight",
        "mtp.layers.0.input_layernorm.weight": "input_layernorm",
        "mtp.layers.0.self_attn.q_proj.weight": "q_proj.weight",
        "mtp.layers.0.self_attn.k_proj.weight": "k_proj.weight",
        "mtp.layers.0.self_attn.v_proj.weight": "v_proj.weight",
        "mtp.layers.0.self_attn.o_proj.weight": "o_proj.weight",
        "mtp.layers.0.post_attention_layernorm.weight": "post_attention_layernorm",
        "mtp.layers.0.mlp.gate_proj.weight": "gate_proj.weight",
        "mtp.layers.0.mlp.up_proj.weight": "up_proj.weight",
        "mtp.layers.0.mlp.down_proj.weight": "down_proj.weight",
        "mtp.norm.weight": "norm",
    }

    def config(self) -> dict:
        return dict(hidden=self.hidden, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim, intermediate=self.intermediate, eps=self.eps, rope_theta=self.rope_theta)

    def file_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as the file stores them: weights in bfloat16, mtp.draft_vocab in int64."""
        params = dict(self.named_parameters())
        out = {name: params[attr].detach().to(torch.bfloat16).contiguous() for name, attr in self.FILE_NAMES.items()}
        out = {name: t.cpu() for name, t in out.items()}
        out["mtp.draft_vocab"] = self.draft_vocab.detach().to(torch.int64).cpu().contiguous()
        return out

    def save(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"format": "pt", "config": json.dumps(self.config()), **(metadata or {})}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(self.file_tensors(), str(path), metadata=meta)

    @classmethod
    def from_file(cls, path: Path, embedding: torch.Tensor, **config) -> "MtpHead":
        """Load a head file (as saved by `save`): weights upcast to float32. `config` overrides the file's metadata
        (whose "config" entry, when absent, defaults to SmolLM2-135M's sizes)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return cls.from_file_tensors(tensors, embedding, **dict(json.loads(meta.get("config", "{}")), **config))

    @classmethod
    def from_file_tensors(cls, tensors: dict[str, torch.Tensor], embedding: torch.Tensor, **config) -> "MtpHead":
        """A head from tensors named as in the file (`file_tensors`)."""
        cfg = dict(SMOLLM2, **config)
        head = cls(embedding, tensors["mtp.draft_vocab"], **cfg)
        params = dict(head.named_parameters())
        with torch.no_grad():
            for name, attr in cls.FILE_NAMES.items():
                params[attr].copy_(tensors[name].float().to(embedding.device))
        return head.eval()

    # -- the math ---------------------------------------------------------------------------------------------

    def lm_rows(self) -> torch.Tensor:
        return self.embedding[self.draft_vocab]

    def _input(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z = fc([rmsnorm(E[token]) * w_pre_e ; rmsnorm(hidden) * w_pre_h])."""
        e = rms_norm(self.embedding[tokens], self.pre_fc_norm_embedding, self.eps)
        g = rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)
        return self.fc(torch.cat((e, g), dim=-1))

    def _qkv(self, z: torch.Tensor, positions: torch.Tensor):
        """z [B, R, H], positions [R] -> q [B, heads, R, d], k and v [B, heads, R, d] (kv heads repeated as HF's
        repeat_kv: query head h reads kv head h // (heads / kv_heads)), q and k rotated."""
        b, r, _ = z.shape
        x = rms_norm(z, self.input_layernorm, self.eps)
        q = self.q_proj(x).view(b, r, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, r, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(positions, self.head_dim, self.rope_theta)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def _finish(self, z: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, heads, R, d] -> o = rmsnorm(out) * w_norm, out = a + mlp(rmsnorm(a)), a = z + o_proj(attn)."""
        b, _, r, _ = attn.shape
        a = z + self.o_proj(attn.transpose(1, 2).reshape(b, r, self.num_heads * self.head_dim))
        y = rms_norm(a, self.post_attention_layernorm, self.eps)
        out = a + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return rms_norm(out, self.norm, self.eps)

    def chain(self, hidden: torch.Tensor, tokens: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Every row's chain, `steps` long, in parallel (for training and evaluation).

        hidden [B, T, H] (the main model's Hs_0..Hs_{T-1}), tokens [B, T]. Step 1 is the real rows r = 0..T-2 (inputs
        Hs_r, x_{r+1}). Step j >= 2 of row r's chain sits at position r+j-1, takes (o of step j-1, x_{r+j}) -- the
        token the chain's drafts would be if all were accepted -- and attends to real rows 0..r, its chain's
        steps 2..j-1 and itself. Returns the normed outputs o per step, each [B, T-1, H]; `logits` scores them."""
        b, t, _ = hidden.shape
        rows = t - 1
        pos = torch.arange(rows, device=hidden.device)
        z = self._input(hidden[:, :-1], tokens[:, 1:])
        q, k1, v1 = self._qkv(z, pos)
        attn = F.scaled_dot_product_attention(q, k1, v1, is_causal=True)
        outs = [self._finish(z, attn)]
        scale = 1.0 / math.sqrt(self.head_dim)
        causal = torch.ones(rows, rows, dtype=torch.bool, device=hidden.device).tril()
        extra_k, extra_v = [], []
        for j in range(2, steps + 1):
            # the token for row r's step j is x_{r+j}; past the end, any token (those rows are never scored)
            tok = F.pad(tokens[:, j:], (0, j - 1), value=0)
            z = self._input(outs[-1], tok)
            q, k, v = self._qkv(z, pos + (j - 1))
            extra_k.append(k)
            extra_v.append(v)
            real = (q @ k1.transpose(-1, -2)) * scale
            real = real.masked_fill(~causal, float("-inf"))
            own = torch.stack([(q * ek).sum(-1) for ek in extra_k], dim=-1) * scale  # [B, heads, R, j-1]
            p = torch.softmax(torch.cat((real, own), dim=-1), dim=-1)
            attn = p[..., :rows] @ v1 + sum(p[..., rows + i, None] * ev for i, ev in enumerate(extra_v))
            outs.append(self._finish(z, attn))
        return outs

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return o @ self.lm_rows().T

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] or [B, T, H], tokens [T] or [B, T] -> logits over the draft vocabulary for rows 0..T-2
        ([.., T-1, N]): row t predicts x_{t+2} from (Hs_t, x_{t+1}). The draft is draft_vocab[argmax]."""
        single = hidden.dim() == 2
        if single:
            hidden, tokens = hidden[None], tokens[None]
        out = self.logits(self.chain(hidden.float(), tokens, 1)[0])
        return out[0] if single else out

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> list[int]:
        """Chained greedy drafts as the engine runs them. hidden [n, H]: Hs_0..Hs_{n-1}; tokens [n+1]: x_0..x_n
        (x_n: the token the main model just picked at position n-1). Returns k drafts for x_{n+1}..x_{n+k}: step 1
        is row n-1; step j >= 2 is a row at position n+j-2 with inputs (o of step j-1, draft j-1), attending to
        real rows 0..n-1, the rows of steps 2..j-1, and itself."""
        hidden = hidden.float()[None]
        n = hidden.shape[1]
        assert tokens.shape[0] == n + 1, "tokens: x_0..x_n, one more than the hidden states"
        z = self._input(hidden, tokens[None, 1:])
        dev = hidden.device
        q, keys, values = self._qkv(z, torch.arange(n, device=dev))
        attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        o = self._finish(z, attn)[:, -1:]  # step 1: row n-1
        drafts = []
        for j in range(1, k + 1):
            d = int(self.draft_vocab[self.logits(o)[0, -1].argmax()])
            drafts.append(d)
            if j == k:
                break
            z = self._input(o, torch.tensor([[d]], device=dev))
            q, kk, vv = self._qkv(z, torch.tensor([n + j - 1], device=dev))
            keys, values = torch.cat((keys, kk), dim=2), torch.cat((values, vv), dim=2)
            attn = F.scaled_dot_product_attention(q, keys, values)  # one query row: sees every cell so far
            o = self._finish(z, attn)
        return drafts


def head_from_model(model, draft_vocab: torch.Tensor, init_layer: int | None = -1,
                    residual_scale: float | None = None, sample: torch.Tensor | None = None) -> MtpHead:
    """A head over a transformers Llama model's sizes, initialised as:

    - fc = [I | I]: z = normed embedding + normed hidden (rms about 1.4); the pre-fc norms and mtp.norm are ones;
    - the decoder layer = the model's layer `init_layer` (the last by default), with o_proj and down_proj divided
      by `residual_scale`: that layer writes into a residual stream of rms ~38 in SmolLM2 (its input at layer 29),
      z is ~27 times smaller, and the rescaled layer changes z by as much, relative to it, as the model's layer
      changes its stream. None: measured here as rms(stream) / rms(z) on the token ids `sample` (random ones if
      None; SmolLM2's own answers give ~27).

    (Measured on 600 steps of SmolLM2: this start and a random one reach the same acceptance; the layer as it is,
    unscaled, or mtp.norm set to the model's final norm, start with far too confident logits and learn slower.)"""
    cfg = model.config
    heads = cfg.num_attention_heads
    head = MtpHead(model.get_input_embeddings().weight, draft_vocab, num_heads=heads,
                   num_kv_heads=cfg.num_key_value_heads or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, rope_theta=_rope_theta(cfg))
    h = cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat((torch.eye(h), torch.eye(h)), dim=1))
        if init_layer is not None:
            layer = model.model.layers[init_layer]
            if residual_scale is None:
                residual_scale = _residual_scale(model, init_layer, sample)
            head.input_layernorm.copy_(layer.input_layernorm.weight)
            head.post_attention_layernorm.copy_(layer.post_attention_layernorm.weight)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(head, name).weight.copy_(getattr(layer.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(head, name).weight.copy_(getattr(layer.mlp, name).weight)
            head.o_proj.weight.div_(residual_scale)
            head.down_proj.weight.div_(residual_scale)
    return head


@torch.no_grad()
def _residual_scale(model, layer: int, sample: torch.Tensor | None = None) -> float:
    """rms of the residual stream entering `layer` over rms of the head's z = [I | I] fc of two normed vectors."""
    if sample is None:
        sample = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    ids = sample.reshape(1, -1).to(model.device)
    states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    stream = float(states[layer % model.config.num_hidden_layers].pow(2).mean().sqrt())
    return max(1.0, stream / math.sqrt(2.0))


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0))


# ----------------------------------------------------------------------------------------------------------------
# Prompts


TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the human heart", "vaccines", "climate change",
    "the French Revolution", "ancient Rome", "the printing press", "the Industrial Revolution", "the Silk Road",
    "the Moon landing", "democracy", "inflation", "supply and demand", "compound interest", "budgeting",
    "machine learning", "the internet", "encryption", "databases", "operating systems", "cloud computing",
    "electric cars", "solar power", "wind turbines", "recycling", "honey bees", "dolphins", "rainforests",
    "deserts", "coral reefs", "earthquakes", "the immune system", "sleep", "healthy eating", "running", "yoga",
    "chess", "football", "the Olympic Games", "jazz music", "Shakespeare", "poetry", "painting", "photography",
    "cooking pasta", "baking bread", "coffee", "tea", "gardening", "houseplants", "dogs", "cats", "birds",
    "time management", "public speaking", "job interviews", "learning a language", "mathematics", "prime numbers",
    "geometry", "probability", "gravity", "electricity", "magnets", "light", "sound", "atoms", "DNA", "evolution",
    "dinosaurs", "the solar system", "Mars", "stars", "the ocean", "rivers", "mountains", "maps", "trains",
    "airplanes", "bicycles", "bridges", "friendship", "kindness", "happiness", "stress", "teamwork", "leadership",
    "social media", "video games", "smartphones", "robots", "3D printing", "the stock market", "small businesses",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the words in a sentence", "finds the largest number in a list",
    "removes duplicates from a list", "checks whether a word is a palindrome", "sorts a list of names",
    "converts Celsius to Fahrenheit", "sums the even numbers in a list", "merges two sorted lists",
    "counts the vowels in a string", "computes the average of a list of numbers", "reads a file and prints each line",
    "finds the greatest common divisor of two numbers", "flattens a nested list", "checks if a year is a leap year",
    "implements binary search", "capitalizes each word in a sentence",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java"]
STORY_SUBJECTS = [
    "a lost robot", "a brave little mouse", "a girl who finds a map", "a dragon who cannot fly", "a lighthouse keeper",
    "two friends on a road trip", "a talking tree", "a detective cat", "a time traveler", "a baker in a small town",
    "a young astronaut", "a musician who lost her voice", "a fox and a crow", "a snowman in summer", "a pirate ship",
]
SENTENCES = [
    "the meeting got moved to thursday cause the boss is sick", "i think we should of left earlier",
    "This product is very good and I like it a lot.", "The results of the experiment was not what we expected.",
    "can u send me the report by tomorrow", "Our team have finished the project on time.",
    "The weather today is nice so we goes to the park.", "He don't know where the keys are.",
]
NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro"]


def _task(topic: str, rng: random.Random) -> str:
    templates = [
        "Explain {t} in simple terms.", "What is {t}? Give a short answer.", "Explain {t} to a ten-year-old.",
        "List five interesting facts about {t}.", "List three advantages and three disadvantages of {t}.",
        "Summarize the main ideas of {t} in one paragraph.", "Write a short poem about {t}.",
        "Write a blog post introduction about {t}.", "Give me three tips related to {t}.",
        "What are the most common misconceptions about {t}?", "Write a quiz with three questions about {t}.",
        "How would you teach {t} to a beginner? Give step-by-step instructions.",
        "Write a short email to {n} recommending they learn about {t}.",
        "Compare {t} and {u}. How are they similar and different?",
        "Why is {t} important? Answer in a few sentences.", "Write a tweet about {t}.",
        "Describe the history of {t} briefly.", "Give an example that shows how {t} works in everyday life.",
    ]
    return rng.choice(templates).format(t=topic, u=rng.choice(TOPICS), n=rng.choice(NAMES))


def make_prompts(n: int, seed: int, topics: list[str]) -> list[str]:
    """`n` varied instructions: explanations, lists, summaries, code, stories, rewrites and questions."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        kind = rng.random()
        if kind < 0.55:
            prompts.append(_task(rng.choice(topics), rng))
        elif kind < 0.7:
            lang, what = rng.choice(LANGUAGES), rng.choice(CODE_TASKS)
            prompts.append(rng.choice([f"Write a {lang} function that {what}.",
                                       f"Write a {lang} function that {what}, and explain how it works.",
                                       f"How do I write code in {lang} that {what}?"]))
        elif kind < 0.82:
            prompts.append(rng.choice(["Write a short story about {s}.", "Tell me a bedtime story about {s}.",
                                       "Write the opening paragraph of a novel about {s}."]).format(
                s=rng.choice(STORY_SUBJECTS)))
        elif kind < 0.9:
            prompts.append(rng.choice(["Rewrite this sentence so it is correct and formal: \"{s}\"",
                                       "Fix the grammar in this sentence: \"{s}\"",
                                       "Rewrite this in a friendly tone: \"{s}\""]).format(s=rng.choice(SENTENCES)))
        else:
            a, b = rng.randint(2, 60), rng.randint(2, 60)
            prompts.append(rng.choice([
                f"{rng.choice(NAMES)} has {a} apples and buys {b} more. "
                f"How many apples does {rng.choice(NAMES)} have now? Explain your reasoning.",
                f"What is {a} times {b}? Show the steps.",
                f"A train travels {a * 10} km in {b % 5 + 1} hours. What is its average speed?",
                f"Is {a * b + 1} a prime number? Explain.",
            ]))
    return prompts


MORE_TOPICS = [
    "the Roman Empire's roads", "the Great Wall of China", "the pyramids of Egypt", "the Renaissance", "the Vikings",
    "the Cold War", "the invention of the telephone", "the history of chocolate", "the first computers",
    "the human brain", "muscles", "the digestive system", "blood types", "allergies", "antibiotics", "nutrition labels",
    "meditation", "habits", "procrastination", "motivation", "memory", "creativity", "empathy", "negotiation",
    "remote work", "email etiquette", "résumés", "personal finance", "saving for retirement", "credit scores",
    "taxes", "renting an apartment", "buying a used car", "home insulation", "composting", "urban farming",
    "beekeeping", "bird migration", "whales", "octopuses", "ants", "wolves", "elephants", "penguins", "sharks",
    "tides", "hurricanes", "tornadoes", "glaciers", "the ozone layer", "lightning", "rainbows", "snowflakes",
    "fractions", "percentages", "algebra", "statistics", "the Pythagorean theorem", "logarithms", "infinity",
    "quantum computing", "blockchain", "virtual reality", "self-driving cars", "drones", "satellites", "GPS",
    "Wi-Fi", "batteries", "semiconductors", "nuclear energy", "hydrogen fuel", "plastics", "glass", "steel",
    "recursion", "sorting algorithms", "version control", "unit testing", "APIs", "web browsers", "passwords",
    "open source software", "spreadsheets", "search engines", "computer viruses", "data privacy",
    "the guitar", "the piano", "classical music", "hip hop", "film making", "animation", "theatre", "novels",
    "mythology", "fairy tales", "the Olympics' history", "basketball", "tennis", "swimming", "hiking", "camping",
    "sailing", "skiing", "marathons", "board games", "puzzles", "magic tricks", "origami", "knitting",
    "wine making", "cheese", "spices", "sushi", "vegetarian cooking", "street food", "breakfast", "desserts",
    "volunteering", "parenting", "grandparents", "moving to a new city", "travelling on a budget", "jet lag",
    "learning to drive", "first aid", "fire safety", "earthquake preparedness", "public libraries", "museums",
    "architecture", "skyscrapers", "castles", "islands", "Japan", "Brazil", "Kenya", "Canada", "Italy", "India",
    "the Amazon river", "the Sahara", "Antarctica", "the Alps", "the Pacific Ocean", "coffee shops", "markets",
]
TEMPLATES_WIDE = [
    "Can you explain {t} in a few paragraphs?", "I don't understand {t}. Can you help?", "tell me about {t}",
    "Write a short article about {t} for a school newspaper.", "What are the key facts everyone should know about {t}?",
    "Give me a simple analogy that explains {t}.", "Write five multiple-choice questions about {t} with answers.",
    "Create an outline for a presentation on {t}.", "What are the pros and cons of {t}?",
    "Write a dialogue between a teacher and a student about {t}.", "Explain {t} as if I were five years old.",
    "Write a limerick about {t}.", "Write a persuasive paragraph arguing that {t} matters.",
    "What are three surprising things about {t}?", "Describe {t} using only simple words.",
    "Write a product description for a book about {t}.", "What questions should I ask an expert on {t}?",
    "Make a study plan for learning about {t} in one week.", "Summarize {t} in exactly three sentences.",
    "What is the connection between {t} and {u}?", "Write a news headline and a short report about {t}.",
    "Give me a fun fact about {t} and explain why it is true.", "How has {t} changed over the last hundred years?",
    "Write a motivational speech that mentions {t}.", "What would the world be like without {t}?",
    "List the main vocabulary words related to {t} with definitions.", "Write a journal entry about a day spent on {t}.",
    "What careers are related to {t}?", "Explain the most common mistakes beginners make with {t}.",
    "Write a short FAQ about {t}.", "Compare the past and the future of {t}.",
]
HOWTOS = [
    "change a flat tire", "make a paper airplane", "start a vegetable garden", "write a good essay",
    "prepare for an exam", "plan a birthday party", "learn to play chess", "clean a laptop keyboard",
    "make a budget spreadsheet", "train a puppy", "improve my handwriting", "fall asleep faster", "make friends at a new school",
    "organize my desk", "write a cover letter", "cook rice", "brew coffee without a machine", "stay focused while studying",
    "set up a home Wi-Fi network", "back up my phone", "paint a room", "start running", "give constructive feedback",
]
PRODUCTS = ["a reusable water bottle", "a solar-powered lamp", "noise-cancelling headphones", "a smart watch",
            "a backpack for hikers", "a coffee grinder", "an electric scooter", "a children's science kit",
            "a standing desk", "a plant-based protein bar"]
HYPOTHETICALS = ["humans could breathe underwater", "the Moon disappeared", "everyone spoke the same language",
                 "there was no electricity for a week", "cars could fly", "animals could talk",
                 "the internet stopped working", "we could live on Mars", "it never rained again",
                 "people lived for two hundred years"]
CODE_SNIPPETS = ["for i in range(5):\n    print(i * i)", "def add(a, b):\n    return a + b",
                 "x = [1, 2, 3]\nprint(sum(x) / len(x))", "while n > 1:\n    n = n // 2\n    steps += 1",
                 "SELECT name FROM users WHERE age > 30;", "const double = (x) => x * 2;",
                 "if word == word[::-1]:\n    print('palindrome')"]
FREEFORM_HELDOUT = [  # never trained on: the held-out figure that matters most (prompts in no template's shape)
    "Explain how a refrigerator keeps food cold.", "Write a short story about a lost umbrella.",
    "List four tips for learning to swim.", "What is the capital of Australia, and why was it chosen?",
    "How do I make a cup of green tea?", "Write a haiku about autumn leaves.", "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.", "Write a Python script that prints the multiplication table from 1 to 10.",
    "What should I pack for a weekend camping trip?", "Describe the plot of Romeo and Juliet.", "Why do cats purr?",
    "Summarize the benefits of drinking water.", "Write a thank-you note to a teacher.",
    "What is the difference between weather and climate?", "How does a bicycle stay upright?",
    "My plants keep dying. What am I doing wrong?", "Suggest a name for my new bakery and explain why.",
    "How can I be more productive in the morning?", "Write a poem about the sea at night.",
    "What is a black hole made of?", "Explain what a neural network is.", "How do airplanes fly?",
    "Write an email asking my manager for a day off.", "What are good habits for healthy teeth?",
    "Tell me a joke about computers.", "How do vaccines train the immune system?", "What is the meaning of life?",
    "Write a JavaScript function that checks if a number is even.", "Explain the rules of soccer.",
    "Plan a three-day trip to Paris.", "Why is the sky blue?", "How do I calm down before a job interview?",
    "Describe a sunset to someone who has never seen one.", "What is the difference between a virus and bacteria?",
    "Write a short speech for my best friend's wedding.", "How does recycling help the environment?",
    "Give me ten ideas for a rainy afternoon.", "What happened during the fall of the Berlin Wall?",
    "How do I sort a list of dictionaries by a key in Python?",
]


def make_prompts_wide(n: int, seed: int, topics: list[str]) -> list[str]:
    """A wider mix than `make_prompts`: its kinds plus many more phrasings, how-tos, products, hypotheticals,
    dialogues and code to explain; casual and formal."""
    rng = random.Random(seed)
    narrow = make_prompts(n, seed + 7919, topics)
    prompts = []
    while len(prompts) < n:
        kind = rng.random()
        t, u = rng.choice(topics), rng.choice(topics)
        if kind < 0.3:
            prompts.append(narrow[len(prompts)])
        elif kind < 0.62:
            prompts.append(rng.choice(TEMPLATES_WIDE).format(t=t, u=u))
        elif kind < 0.72:
            h = rng.choice(HOWTOS)
            prompts.append(rng.choice(["How do I {h}?", "What are the steps to {h}?", "Give me a checklist to {h}.",
                                       "I want to {h}. Where do I start?", "how to {h}"]).format(h=h))
        elif kind < 0.78:
            prompts.append(rng.choice(["Write a product description for {p}.", "Write an advert for {p}.",
                                       "Write a customer review of {p}.", "What should I look for when buying {p}?"]
                                      ).format(p=rng.choice(PRODUCTS)))
        elif kind < 0.84:
            prompts.append(rng.choice(["What would happen if {h}?", "Imagine that {h}. Describe a day in that world.",
                                       "Write a short story set in a world where {h}."]).format(
                h=rng.choice(HYPOTHETICALS)))
        elif kind < 0.9:
            code = rng.choice(CODE_SNIPPETS)
            prompts.append(rng.choice(["Explain what this code does:\n{c}", "Is there a bug in this code?\n{c}",
                                       "Rewrite this code to be clearer:\n{c}"]).format(c=code))
        elif kind < 0.95:
            a, b = rng.sample(NAMES, 2)
            prompts.append(rng.choice([f"Write a dialogue between {a} and {b} about {t}.",
                                       f"{a} and {b} disagree about {t}. Help them find common ground.",
                                       f"Write a letter from {a} to {b} about {t}."]))
        else:
            lang, what = rng.choice(LANGUAGES), rng.choice(CODE_TASKS)
            prompts.append(rng.choice([f"Write unit tests for a {lang} function that {what}.",
                                       f"Explain, step by step, an algorithm that {what}.",
                                       f"Write a {lang} function that {what}. Add comments."]))
    return prompts


# ----------------------------------------------------------------------------------------------------------------
# Data: the main model answers, and its hidden states and greedy picks are recorded on the way


@dataclass
class Sequence:
    tokens: torch.Tensor   # int64 [L]: x_0..x_{L-1} (prompt, then the answer)
    hidden: torch.Tensor   # float16 [L, H]: Hs_0..Hs_{L-1} (after the final norm)
    greedy: torch.Tensor   # int64 [L]: y_p, the main model's argmax at position p (its pick for x_{p+1})
    top_ids: torch.Tensor  # int64 [L, TOPK]
    top_p: torch.Tensor    # float16 [L, TOPK]: the main model's probabilities for them
    prompt_len: int
    sampled: bool


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], sampled: list[bool], max_new: int, temperature: float, eos: int,
                 gen: torch.Generator, store: str | torch.device = "cpu") -> list[Sequence]:
    """Answer left-padded prompts in one batch with a KV cache: greedy rows pick the argmax, sampled rows draw at
    `temperature`. Every fed position's hidden state, argmax and top-k probabilities are recorded (into buffers on
    the model's device, one column per position). A row ends at `eos` or after `max_new` tokens; finished rows leave
    the batch. The last picked token of each row is not fed, so it is dropped (its pick y_{L-1} is kept as the last
    row's target). The sequences' tensors are returned on `store`."""
    from transformers import DynamicCache

    dev = model.device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    hs = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).last_hidden_state
    lm = model.get_output_embeddings().weight
    # column c of the buffers is position c - (width - len(prompt)) of a row; the prompt's last position is column
    # width - 1, the answer's k-th pick (k = 0, 1, ..) is token column width + k, fed to give hidden column width + k
    cols = width + max_new
    tok_buf = torch.zeros(b, cols, dtype=torch.int64, device=dev)
    hid_buf = torch.zeros(b, cols, hs.shape[-1], dtype=torch.float16, device=dev)
    top_ids_buf = torch.zeros(b, cols, TOPK, dtype=torch.int64, device=dev)
    top_p_buf = torch.zeros(b, cols, TOPK, dtype=torch.float16, device=dev)
    tok_buf[:, :width] = ids
    hid_buf[:, :width] = hs.half()
    chunk = max(1, 4096 // width)  # the prompt positions' top-k, a few rows at a time (logits: rows x V floats)
    for start in range(0, b, chunk):
        top_p, top_ids = torch.softmax(hs[start:start + chunk, :-1] @ lm.T, dim=-1).topk(TOPK, dim=-1)
        top_ids_buf[start:start + chunk, :width - 1] = top_ids
        top_p_buf[start:start + chunk, :width - 1] = top_p.half()
    picked = [max_new] * b  # picks made per row
    live = torch.arange(b, device=dev)  # batch row -> buffer row
    live_list = list(range(b))
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    last = hs[:, -1]
    sampled_all = torch.tensor(sampled, device=dev)
    for step in range(max_new):
        logits = last @ lm.T
        top_p, top_ids = torch.softmax(logits, dim=-1).topk(TOPK, dim=-1)
        pick = top_ids[:, 0].clone()
        rows_s = sampled_all[live]
        if bool(rows_s.any()):
            probs = torch.softmax(logits[rows_s] / temperature, dim=-1)
            pick[rows_s] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        tok_buf[live, width + step] = pick
        top_ids_buf[live, width - 1 + step] = top_ids
        top_p_buf[live, width - 1 + step] = top_p.half()
        if step == max_new - 1:
            break
        # rows that pick `eos` are done; they leave the batch once they are an eighth of it (until then they run on,
        # and what they write past their end is never read): each leaving copies the whole KV cache
        ended = ((pick == eos) & alive).nonzero()[:, 0].tolist()
        for row in ended:
            picked[live_list[row]] = step + 1
        if ended:
            alive[ended] = False
            dead = len(live_list) - int(alive.sum())
            if dead == len(live_list):
                break
            if dead * 8 >= len(live_list):
                idx = alive.nonzero()[:, 0]
                cache.batch_select_indices(idx)
                mask, pos, pick, live, alive = mask[idx], pos[idx], pick[idx], live[idx], alive[idx]
                live_list = [live_list[r] for r in idx.tolist()]
        mask = torch.cat((mask, torch.ones(len(live_list), 1, dtype=mask.dtype, device=dev)), dim=1)
        pos = pos[:, -1:] + 1
        out = model.model(input_ids=pick[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                          use_cache=True).last_hidden_state
        last = out[:, -1]
        hid_buf[live, width + step] = last.half()
    seqs = []
    for i, p in enumerate(prompts):
        lo, hi = width - len(p), width + picked[i] - 1  # fed positions: every token but the last picked
        take = lambda buf: buf[i, lo:hi].to(store, copy=True)  # noqa: E731  (not a view of the whole buffer)
        top_ids = take(top_ids_buf)
        seqs.append(Sequence(take(tok_buf), take(hid_buf), top_ids[:, 0].clone(), top_ids, take(top_p_buf),
                             len(p), sampled[i]))
    return seqs


def load_main_model(gguf: Path | None = None, tokenizer: Path | None = None):
    """The main model in float32 (transformers dequantizes the GGUF; it needs the `gguf` package) and its tokenizer:
    from the GGUF too (with its chat template), or from `tokenizer`, a folder with tokenizer.json and
    tokenizer_config.json (the same tokens and template, without converting the GGUF's vocabulary)."""
    import transformers

    if gguf is None:
        from strata.model.loader import default_model_path

        gguf = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if tokenizer is not None:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tok


def build_data(model, tokenizer, args, log=print) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
    """Training answers (about args.tokens tokens in all, half greedy and half sampled), held-out answers (prompts
    on topics the training prompts never use, half greedy) and, for the wide prompt set, greedy answers to
    FREEFORM_HELDOUT (hand-written prompts in no template's shape); cached under args.cache_dir."""
    wide = args.prompt_set == "wide"
    topics = sorted(TOPICS + (MORE_TOPICS if wide else []))
    random.Random(args.seed).shuffle(topics)
    n_held = max(1, len(topics) // 10)
    held_topics, train_topics = topics[:n_held], topics[n_held:]
    generate_prompts = make_prompts_wide if wide else make_prompts
    settings = dict(v=3, tokens=args.tokens, max_new=args.max_new, temperature=args.temperature, seed=args.seed,
                    heldout=args.heldout, model=str(args.gguf_id), topics=topics)
    if wide:
        settings.update(prompts="wide", freeform=FREEFORM_HELDOUT)
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]
    path = None if args.cache_dir is None else args.cache_dir / f"mtp-smollm2-{key}.pt"
    store = args.device
    if path is not None and path.exists() and not args.regenerate:
        log(f"data: cached {path}")
        data = torch.load(path, weights_only=False)
        return tuple([_seq(x, store) for x in data[part]] for part in ("train", "heldout", "freeform"))

    def encode(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = torch.Generator(model.device).manual_seed(args.seed)
    t0 = time.time()

    def run(prompts: list[str], sampled_flags: list[bool], budget: int | None, tag: str) -> list[Sequence]:
        out, total = [], 0
        for start in range(0, len(prompts), args.gen_batch):
            chunk = prompts[start:start + args.gen_batch]
            seqs = answer_batch(model, [encode(p) for p in chunk], sampled_flags[start:start + args.gen_batch],
                                args.max_new, args.temperature, eos, gen, store)
            out += seqs
            total += sum(len(s.tokens) for s in seqs)
            log(f"  {tag}: {len(out)} answers, {total} tokens, {time.time() - t0:.0f} s")
            if budget is not None and (total >= budget or (args.gen_time_limit is not None
                                                            and time.time() - t0 > args.gen_time_limit)):
                break
        return out

    held_prompts = generate_prompts(args.heldout, args.seed + 1, held_topics)
    heldout = run(held_prompts, [i % 2 == 1 for i in range(len(held_prompts))], None, "held-out")
    freeform = run(FREEFORM_HELDOUT, [False] * len(FREEFORM_HELDOUT), None, "free-form") if wide else []
    train_prompts = generate_prompts(4 * args.tokens // 200, args.seed + 2, train_topics)
    train = run(train_prompts, [i % 2 == 1 for i in range(len(train_prompts))], args.tokens, "train")
    if args.cache_dir is not None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        torch.save({part: [_seq(x, "cpu").__dict__ for x in seqs]
                    for part, seqs in (("train", train), ("heldout", heldout), ("freeform", freeform))}, path)
    log(f"data: {len(train)} training answers, {sum(len(s.tokens) for s in train)} tokens; {len(heldout)} held-out, "
        f"{len(freeform)} free-form ({time.time() - t0:.0f} s)" + (f", cached in {path}" if args.cache_dir else ""))
    return train, heldout, freeform


def _seq(x, device: str | torch.device | None = None) -> Sequence:
    """A Sequence (from a cached dict too), its tensors moved to `device` if given."""
    s = x if isinstance(x, Sequence) else Sequence(**x)
    if device is None:
        return s
    return Sequence(*(getattr(s, f).to(device) for f in ("tokens", "hidden", "greedy", "top_ids", "top_p")),
                    s.prompt_len, s.sampled)


def token_counts(seqs: list[Sequence], vocab: int) -> torch.Tensor:
    """How often each token is an answer token or the main model's pick there (on the CPU)."""
    ids = torch.cat([t for s in seqs for t in (s.tokens[s.prompt_len:], s.greedy[s.prompt_len - 1:])])
    return torch.bincount(ids, minlength=vocab).cpu()


def choose_draft_vocab(seqs: list[Sequence], size: int, vocab: int, within: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent tokens of the answers (and the main model's picks there), sorted ascending;
    `within`: chosen among these token ids only."""
    counts = token_counts(seqs, vocab)
    pool = torch.arange(vocab) if within is None else within
    return pool[counts[pool].topk(min(size, len(pool))).indices].sort().values


# ----------------------------------------------------------------------------------------------------------------
# Training


@dataclass
class Batch:
    hidden: torch.Tensor  # [B, T, H] float32
    tokens: torch.Tensor  # [B, T]
    targets: list[torch.Tensor]  # per step j: [B, T-1] index into the draft vocab, -1: unscored, -2: outside vocab
    top_idx: list[torch.Tensor]  # per step: [B, T-1, TOPK] draft index of the teacher's top ids (-1 outside)
    top_p: list[torch.Tensor]    # per step: [B, T-1, TOPK]
    noisy_hidden: torch.Tensor | None = None  # what the head reads when training with noise (else `hidden`)

    def to(self, device) -> "Batch":
        move = lambda ts: [t.to(device, non_blocking=True) for t in ts]  # noqa: E731
        noisy = None if self.noisy_hidden is None else self.noisy_hidden.to(device)
        return Batch(self.hidden.to(device), self.tokens.to(device), move(self.targets), move(self.top_idx),
                     move(self.top_p), noisy)


def make_batch(seqs: list[Sequence], steps: int, vocab_index: torch.Tensor, noise: float = 0.0,
               gen: torch.Generator | None = None) -> Batch:
    """Row r's step-j target is y_{r+j}, the main model's pick for x_{r+j+1}; it is scored when x_{r+j+1} is an
    answer token and the chain is real: x_{r+i+1} == y_{r+i} for i = 1..j-1 (the earlier drafts, if accepted, are
    the tokens that follow in the text). Built on the sequences' device. `noise` > 0: the hidden states the head
    reads get Gaussian noise of rms up to 2 * `noise` times each row's rms (uniform per sequence; the feature
    targets stay clean), as a main model running in bfloat16 moves them (about 2 % for SmolLM2)."""
    from torch.nn.utils.rnn import pad_sequence

    dev = seqs[0].hidden.device
    b = len(seqs)
    n = torch.tensor([len(s.tokens) for s in seqs], device=dev)
    plen = torch.tensor([s.prompt_len for s in seqs], device=dev)
    t = int(n.max())
    hidden = pad_sequence([s.hidden for s in seqs], batch_first=True).float()
    tokens = pad_sequence([s.tokens for s in seqs], batch_first=True)
    greedy = pad_sequence([s.greedy for s in seqs], batch_first=True)
    top_ids = pad_sequence([s.top_ids for s in seqs], batch_first=True)
    top_prob = pad_sequence([s.top_p for s in seqs], batch_first=True).float()
    vocab_index = vocab_index.to(dev)
    # match[:, p]: x_{p+1} == y_p, for p = 0..n-2 (False past them, and in the padding up to t - 1 + steps)
    match = torch.zeros(b, t - 1 + steps, dtype=torch.bool, device=dev)
    match[:, :t - 1] = (tokens[:, 1:] == greedy[:, :-1]) & (torch.arange(t - 1, device=dev) < (n - 1)[:, None])
    r = torch.arange(t - 1, device=dev)
    ok = (r < (n - 1)[:, None])  # real rows
    targets, top_idx, top_p = [], [], []
    for j in range(1, steps + 1):
        if j > 1:
            ok = ok & match[:, r + j - 1]
        p = r + j  # target position
        valid = ok & (p[None] <= (n - 1)[:, None]) & (p[None] >= (plen - 1)[:, None])
        pc = p.clamp(max=t - 1)
        idx = vocab_index[greedy[:, pc]]
        tgt = torch.where(idx >= 0, idx, torch.full_like(idx, -2))
        targets.append(torch.where(valid, tgt, torch.full_like(tgt, -1)))
        top_idx.append(torch.where(valid[..., None], vocab_index[top_ids[:, pc]], torch.full_like(top_ids[:, pc], -1)))
        top_p.append(torch.where(valid[..., None], top_prob[:, pc], torch.zeros_like(top_prob[:, pc])))
    batch = Batch(hidden, tokens, targets, top_idx, top_p)
    if noise > 0:
        scale = hidden.pow(2).mean(-1, keepdim=True).sqrt()
        level = 2 * noise * torch.rand(b, 1, 1, device=dev, generator=gen)
        batch.noisy_hidden = hidden + torch.randn(hidden.shape, device=dev, generator=gen) * scale * level
    return batch


def batches(seqs: list[Sequence], batch_tokens: int, rng: random.Random | None) -> list[list[Sequence]]:
    """Sequences of similar length together, up to `batch_tokens` padded tokens a batch; shuffled when rng."""
    order = sorted(seqs, key=lambda s: len(s.tokens))
    out, cur = [], []
    for s in order:
        if cur and (len(cur) + 1) * len(s.tokens) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    if rng is not None:
        rng.shuffle(out)
    return out


def step_loss(head: MtpHead, batch: Batch, weights: list[float], soft: float, feat: float = 0.0):
    """The chained loss: per step j, cross-entropy to the main model's pick (in the draft vocabulary), plus `soft`
    times the cross-entropy to its top-k probabilities (those inside the draft vocabulary, renormalised), plus
    `feat` times a smooth-L1 distance between the head's normed output o and the main model's own final hidden
    state at the target position, Hs_{r+j} (what its LM head reads there: o ~ Hs makes the head's logits the main
    model's, and step j+1's input (o, draft) the real row's). Returns (loss, per-step hits, per-step counts)."""
    inputs = batch.hidden if batch.noisy_hidden is None else batch.noisy_hidden
    outs = head.chain(inputs, batch.tokens, len(weights))
    total, hits, counts = 0.0, [], []
    for j, (o, w) in enumerate(zip(outs, weights)):
        tgt = batch.targets[j]
        scored = tgt >= 0
        if not scored.any():
            hits.append(torch.zeros((), dtype=torch.int64, device=tgt.device))
            counts.append(torch.zeros((), dtype=torch.int64, device=tgt.device))
            continue
        logp = torch.log_softmax(head.logits(o[scored]), dim=-1)
        loss = F.nll_loss(logp, tgt[scored])
        if soft:
            idx, p = batch.top_idx[j][scored], batch.top_p[j][scored]
            p = torch.where(idx >= 0, p, torch.zeros_like(p))
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-6)
            loss = loss - soft * (p * logp.gather(1, idx.clamp(min=0))).sum(-1).mean()
        if feat:
            real = tgt != -1  # outside the draft vocabulary too: the hidden state is still a target
            target = batch.hidden[:, j + 1:]
            loss = loss + feat * F.smooth_l1_loss(o[:, :target.shape[1]][real[:, :target.shape[1]]],
                                                  target[real[:, :target.shape[1]]])
        total = total + w * loss
        hits.append((logp.argmax(-1) == tgt[scored]).sum())
        counts.append(scored.sum())
    return total, hits, counts


@torch.no_grad()
def evaluate(head: MtpHead, seqs: list[Sequence], k: int = 4, batch_tokens: int = 4096,
             subset: torch.Tensor | None = None) -> dict:
    """Acceptance per draft position, chained as the engine runs it: position j counts as accepted only if the
    drafts at positions 1..j all equal the main model's picks. Rows: every answer position whose k targets exist
    and whose chain is real (always so for greedy answers). A target outside the draft vocabulary is a miss.
    `subset`: score only these draft-vocabulary indices (a smaller draft vocabulary's estimate)."""
    head.eval()
    vocab_index = _vocab_index(head)
    acc = torch.zeros(k)
    rows = 0
    outside = 0
    for group in batches(seqs, batch_tokens, None):
        b = make_batch(group, k, vocab_index).to(head.embedding.device)
        outs = head.chain(b.hidden, b.tokens, k)
        ok = torch.ones_like(b.targets[0], dtype=torch.bool)
        scored = torch.ones_like(ok)
        for j in range(k):
            scored &= b.targets[j] != -1
        for j in range(k):
            logits = head.logits(outs[j])
            if subset is not None:
                masked = torch.full_like(logits, float("-inf"))
                masked[..., subset.to(logits.device)] = logits[..., subset.to(logits.device)]
                logits = masked
            ok &= logits.argmax(-1) == b.targets[j]
            acc[j] += int((ok & scored).sum())
        rows += int(scored.sum())
        outside += int((scored & (b.targets[0] == -2)).sum())
    per_pos = (acc / max(rows, 1)).tolist()
    return {"accept": per_pos, "rows": rows, "outside_vocab": outside / max(rows, 1),
            "mean_accepted": [sum(per_pos[:i + 1]) for i in range(k)]}


def _vocab_index(head: MtpHead) -> torch.Tensor:
    index = torch.full((head.embedding.shape[0],), -1, dtype=torch.int64)
    index[head.draft_vocab.cpu()] = torch.arange(len(head.draft_vocab))
    return index


def train_head(head: MtpHead, train: list[Sequence], heldout: list[Sequence], *, epochs: float, lr: float,
               batch_tokens: int, weights: list[float], soft: float, feat: float = 0.0, seed: int = 0, log=print,
               eval_every: int = 25, time_limit: float | None = None, noise: float = 0.0,
               on_eval=None) -> list[dict]:
    """AdamW with a linear warm-up and a cosine decay; the main model's hidden states are inputs, the embedding
    is frozen. The decay runs over `epochs` or, when it comes first, `time_limit` seconds (progress is the larger of
    the step's share and the time's share), so a time-limited run still ends at the low learning rate. `noise`: see
    `make_batch`. `on_eval(head, entry)` is called at every evaluation. Returns the log (step, loss, held-out
    acceptance@1)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dev = head.embedding.device
    gen = torch.Generator(train[0].hidden.device).manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    vocab_index = _vocab_index(head).to(train[0].hidden.device)
    per_epoch = len(batches(train, batch_tokens, None))
    total = max(1, int(epochs * per_epoch))
    warm = max(1, min(40, total // 10))
    t0 = time.time()

    def progress(s: int) -> float:
        p = s / total
        if time_limit is not None:
            p = max(p, (time.time() - t0) / time_limit)
        return min(1.0, p)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress(s)))))
    history, step = [], 0
    zeros = lambda: [torch.zeros((), dtype=torch.int64, device=dev) for _ in weights]  # noqa: E731
    run_loss, run_n, run_hits, run_counts = torch.zeros((), device=dev), 0, zeros(), zeros()
    while step < total:
        for group in batches(train, batch_tokens, rng):
            head.train()
            batch = make_batch(group, len(weights), vocab_index, noise, gen).to(dev)
            loss, hits, counts = step_loss(head, batch, weights, soft, feat)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            run_loss += loss.detach()
            run_n += 1
            run_hits = [a + b for a, b in zip(run_hits, hits)]
            run_counts = [a + b for a, b in zip(run_counts, counts)]
            last = step >= total or progress(step) >= 1.0
            if step % eval_every == 0 or last:
                entry = {"step": step, "loss": float(run_loss) / run_n,
                         "train_acc": [int(h) / max(int(c), 1) for h, c in zip(run_hits, run_counts)],
                         "time": time.time() - t0, "lr": sched.get_last_lr()[0]}
                if heldout:
                    entry["heldout_accept1"] = evaluate(head, heldout, k=1)["accept"][0]
                history.append(entry)
                log(f"step {step}/{total}  loss {entry['loss']:.3f}  train acc/step "
                    + " ".join(f"{a:.3f}" for a in entry["train_acc"])
                    + (f"  held-out acc@1 {entry['heldout_accept1']:.3f}" if heldout else "")
                    + f"  lr {entry['lr']:.2e}  {entry['time']:.0f} s")
                run_loss, run_n, run_hits, run_counts = torch.zeros((), device=dev), 0, zeros(), zeros()
                if on_eval is not None:
                    on_eval(head, entry)
            if last:
                return history
    return history


# ----------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the head file to write")
    ap.add_argument("--gguf", type=Path, default=None, help="the main model (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=150_000, help="training tokens to generate (prompts included)")
    ap.add_argument("--heldout", type=int, default=48, help="held-out prompts (half answered greedily)")
    ap.add_argument("--max-new", type=int, default=256, help="answer length cap")
    ap.add_argument("--temperature", type=float, default=0.7, help="for the sampled half of the answers")
    ap.add_argument("--gen-batch", type=int, default=48, help="answers generated together")
    ap.add_argument("--regenerate", action="store_true", help="ignore the cached answers")
    ap.add_argument("--data-only", action="store_true", help="stop once the answers are generated and cached")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head is trained to score")
    ap.add_argument("--ship-vocab", type=int, default=8192,
                    help="tokens the shipped head scores: the most frequent of the trained vocabulary")
    ap.add_argument("--from-head", type=Path, default=None,
                    help="a trained head file: evaluate it and write it with --ship-vocab tokens, no training")
    ap.add_argument("--epochs", type=float, default=5.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per training batch")
    ap.add_argument("--steps", type=str, default="1,0.6,0.4,0.25",
                    help="loss weight per chained step (as many steps as weights)")
    ap.add_argument("--soft", type=float, default=0.5, help="weight of the top-k soft-target cross-entropy")
    ap.add_argument("--feat", type=float, default=5.0,
                    help="weight of the smooth-L1 distance from the head's output to the main model's next hidden "
                         "state")
    ap.add_argument("--time-limit", type=float, default=None, help="stop training after this many seconds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="where the main model and the head run (cpu, cuda)")
    ap.add_argument("--cache-dir", type=Path, default=CACHE, help="where generated answers are cached")
    ap.add_argument("--prompt-set", choices=("narrow", "wide"), default="wide",
                    help="narrow: the first generator (topics x 18 templates, code, stories, rewrites, arithmetic); "
                         "wide: that mixed with many more phrasings and kinds, plus hand-written free-form "
                         "held-out prompts")
    ap.add_argument("--gen-time-limit", type=float, default=None,
                    help="stop generating training answers after this many seconds")
    ap.add_argument("--no-cache", action="store_true", help="neither read nor write the answers' cache")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a folder with tokenizer.json and tokenizer_config.json (default: the GGUF's own)")
    ap.add_argument("--total-time-limit", type=float, default=None,
                    help="end training so that the whole run ends within this many seconds (--reserve kept for "
                         "the final evaluation)")
    ap.add_argument("--reserve", type=float, default=30.0, help="seconds kept after training (--total-time-limit)")
    ap.add_argument("--hidden-noise", type=float, default=0.02,
                    help="Gaussian noise on the hidden states the head reads while training, relative to their rms "
                         "(up to twice this, uniform per answer): robustness to a main model run in bfloat16")
    ap.add_argument("--eval-every", type=int, default=25, help="training steps between held-out evaluations")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="write the head (trained vocabulary) here while training, every --checkpoint-every s")
    ap.add_argument("--checkpoint-every", type=float, default=60.0)
    ap.add_argument("--compare-head", type=Path, action="append", default=[],
                    help="a head file to evaluate on the same answers (repeatable)")
    ap.add_argument("--save-eval", type=Path, default=None,
                    help="a folder: write the free-form and held-out greedy answers there (freeform_<i>.pt, "
                         "heldout_greedy_<i>.pt: lists of Sequence fields)")
    ap.add_argument("--results", type=Path, default=None, help="write every evaluation and the training log (JSON)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.no_cache:
        args.cache_dir = None
    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f} s] {msg}", flush=True)

    model, tokenizer = load_main_model(args.gguf, args.tokenizer)
    model.to(args.device)
    torch.set_float32_matmul_precision("highest")  # float32 products in full precision on GPUs too (no TF32)
    src = args.gguf
    if src is None:
        from strata.model.loader import default_model_path

        src = default_model_path()
    args.gguf_id = f"{src.name}:{src.stat().st_size}"
    for p in model.parameters():
        p.requires_grad_(False)
    log("main model loaded")
    train, heldout, freeform = build_data(model, tokenizer, args, log)
    t_data = time.time() - t_start
    if args.save_eval:  # the greedy evaluation answers, to measure other heads on the very same text elsewhere
        args.save_eval.mkdir(parents=True, exist_ok=True)
        for part, seqs in (("freeform", freeform), ("heldout_greedy", [s for s in heldout if not s.sampled])):
            chunks, cur = [], []  # files of at most 11,000 tokens (about 15 MB)
            for s in seqs:
                if cur and sum(len(x.tokens) for x in cur) + len(s.tokens) > 11_000:
                    chunks.append(cur)
                    cur = []
                cur.append(s)
            for i, chunk in enumerate(chunks + [cur]):
                torch.save([_seq(x, "cpu").__dict__ for x in chunk], args.save_eval / f"{part}_{i}.pt")
    if args.data_only:
        return 0
    greedy_held = [s for s in heldout if not s.sampled]
    sampled_held = [s for s in heldout if s.sampled]
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in train)
    log(f"training answers: {len(train)}, {sum(len(s.tokens) for s in train)} tokens ({answer_tokens} answer tokens); "
        f"held-out: {len(greedy_held)} greedy + {len(sampled_held)} sampled answers, {len(freeform)} free-form")
    watch = freeform or greedy_held  # the held-out set printed while training
    eval_sets = (("free-form", freeform), ("held-out topics", greedy_held), ("sampled", sampled_held))
    embedding = model.get_input_embeddings().weight

    def report(name: str, h: MtpHead, sets=eval_sets) -> dict:
        out = {}
        for label, seqs in sets:
            if not seqs:
                continue
            r = out[label] = evaluate(h, seqs, k=4)
            log(f"{name} ({len(h.draft_vocab)} draft tokens), {label} answers ({r['rows']} positions): "
                f"acceptance per position {_fmt(r['accept'])}, expected accepted drafts for K=1..4 "
                f"{_fmt(r['mean_accepted'])}, targets outside the draft vocabulary {r['outside_vocab']:.3f}")
        return out

    results: dict[str, dict] = {}
    for path in args.compare_head:
        results[f"compare:{path.name}"] = report(f"compare {path.name}", MtpHead.from_file(path, embedding))

    vocab = choose_draft_vocab(train, args.draft_vocab, model.config.vocab_size)
    weights = [float(w) for w in args.steps.split(",")]
    history: list[dict] = []
    if args.from_head:
        head = MtpHead.from_file(args.from_head, embedding)
        log(f"trained head from {args.from_head}: {len(head.draft_vocab)} draft tokens (no training)")
    else:
        sample = torch.cat([s.tokens for s in train[:4]])
        head = head_from_model(model, vocab, sample=sample)
        log(f"draft vocabulary: {len(vocab)} tokens; decoder layer from the main model's last, o_proj and down_proj "
            f"divided by {_residual_scale(model, -1, sample):.1f}")
        before = evaluate(head, watch, k=4)
        log(f"before training: held-out acceptance per position {_fmt(before['accept'])}")
        time_limit = args.time_limit
        if args.total_time_limit is not None:  # leave time for the final evaluation and the files
            left = args.total_time_limit - (time.time() - t_start) - args.reserve
            time_limit = left if time_limit is None else min(time_limit, left)
            log(f"training for at most {time_limit:.0f} s")
        if args.device != "cpu":
            torch.set_float32_matmul_precision("high")  # training: TF32 products are fine
        last_save = [time.time()]

        def checkpoint(h: MtpHead, entry: dict) -> None:
            if args.checkpoint is not None and time.time() - last_save[0] > args.checkpoint_every:
                h.save(args.checkpoint, {"step": str(entry["step"]), "draft_vocab_note": "trained vocabulary"})
                last_save[0] = time.time()

        history = train_head(head, train, watch, epochs=args.epochs, lr=args.lr,
                             batch_tokens=args.batch_tokens, weights=weights, soft=args.soft, feat=args.feat,
                             seed=args.seed, log=log, time_limit=time_limit, noise=args.hidden_noise,
                             eval_every=args.eval_every, on_eval=checkpoint)
        torch.set_float32_matmul_precision("highest")
    del model
    t_train = time.time() - t_start - t_data

    # what ships: the bfloat16 weights (loaded back), scoring the `ship_vocab` most frequent tokens, a subset of
    # the trained vocabulary (the same weights; the drafts rarely are rarer tokens, so acceptance barely moves)
    tmp = args.out.with_suffix(".tmp")
    head.save(tmp)
    trained = MtpHead.from_file(tmp, head.embedding)
    tmp.unlink()
    if args.checkpoint is not None and history:
        head.save(args.checkpoint, {"step": str(history[-1]["step"]), "draft_vocab_note": "trained vocabulary"})
    ship = choose_draft_vocab(train, args.ship_vocab, len(head.embedding), within=trained.draft_vocab.cpu())
    shipped = MtpHead.from_file_tensors(trained.file_tensors() | {"mtp.draft_vocab": ship}, head.embedding,
                                        **trained.config())
    results["trained"] = report("trained", trained, eval_sets[:2])
    results["shipped"] = report("shipped", shipped)
    result = results["shipped"]["free-form" if freeform else "held-out topics"]
    topics_result, sampled_result = results["shipped"]["held-out topics"], results["shipped"]["sampled"]
    meta = {
        "base_model": "SmolLM2-135M-Instruct",
        "trained_by": "train/mtp_head.py",
        "acceptance_per_position": json.dumps([round(a, 4) for a in result["accept"]]),
        "acceptance_note": ("greedy answers to hand-written prompts never trained on (FREEFORM_HELDOUT)" if freeform
                            else "held-out greedy answers to chat prompts on topics the training prompts never use")
        + "; position j counts only if positions < j were accepted; targets outside the draft vocabulary are misses",
        "acceptance_heldout_topics": json.dumps([round(a, 4) for a in topics_result["accept"]]),
        "acceptance_sampled_answers": json.dumps([round(a, 4) for a in sampled_result["accept"]]),
        "draft_vocab_outside_share": f"{result['outside_vocab']:.4f}",
        "hidden_input": "the main model's final hidden state after its final norm (what its LM head reads)",
        "training": json.dumps({"answers": len(train), "tokens": sum(len(s.tokens) for s in train),
                                "trained_vocab": len(trained.draft_vocab), "epochs": args.epochs, "lr": args.lr,
                                "step_weights": weights, "soft": args.soft, "feat": args.feat,
                                "hidden_noise": args.hidden_noise, "batch_tokens": args.batch_tokens,
                                "steps": history[-1]["step"] if history else None,
                                "train_seconds": round(history[-1]["time"]) if history else None,
                                "prompt_set": args.prompt_set, "device": args.device}),
    }
    if args.from_head:  # keep the training record of the file it came from
        from safetensors import safe_open

        with safe_open(str(args.from_head), framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("training", "{}"))
        record.setdefault("trained_vocab", len(trained.draft_vocab))
        meta["training"] = json.dumps(record)
    shipped.save(args.out, meta)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"results": results, "history": history, "meta": meta,
                                            "data_seconds": t_data, "train_seconds": t_train}, indent=1))
    log(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB); data {t_data:.0f} s, training {t_train:.0f} s, "
        f"total {time.time() - t_start:.0f} s")
    return 0


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


if __name__ == "__main__":
    raise SystemExit(main())
