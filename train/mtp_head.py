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

See train/README.md for the measured acceptance and the time it takes."""

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
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
        out["mtp.draft_vocab"] = self.draft_vocab.detach().to(torch.int64).contiguous()
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
                params[attr].copy_(tensors[name].float())
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
        q, keys, values = self._qkv(z, torch.arange(n))
        attn = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
        o = self._finish(z, attn)[:, -1:]  # step 1: row n-1
        drafts = []
        for j in range(1, k + 1):
            d = int(self.draft_vocab[self.logits(o)[0, -1].argmax()])
            drafts.append(d)
            if j == k:
                break
            z = self._input(o, torch.tensor([[d]]))
            q, kk, vv = self._qkv(z, torch.tensor([n + j - 1]))
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
    ids = sample.reshape(1, -1)
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
                 gen: torch.Generator) -> list[Sequence]:
    """Answer left-padded prompts in one batch with a KV cache: greedy rows pick the argmax, sampled rows draw at
    `temperature`. Every fed position's hidden state, argmax and top-k probabilities are recorded. A row ends at
    `eos` or after `max_new` tokens; finished rows leave the batch. The last picked token of each row is not fed,
    so it is dropped (its pick y_{L-1} is kept as the last row's target)."""
    from transformers import DynamicCache

    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    hs = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).last_hidden_state
    lm = model.get_output_embeddings().weight
    rec = []
    for i, p in enumerate(prompts):
        h = hs[i, width - len(p):-1]  # prompt positions but the last (the loop scores that one)
        top_p, top_ids = torch.softmax(h @ lm.T, dim=-1).topk(TOPK, dim=-1)
        rec.append(dict(tokens=list(p), hidden=[hs[i, width - len(p):]], top_ids=[top_ids], top_p=[top_p]))
    live = list(range(b))  # batch row -> sequence
    last = hs[:, -1]
    sampled_t = torch.tensor(sampled)
    for step in range(max_new):
        logits = last @ lm.T
        top_p, top_ids = torch.softmax(logits, dim=-1).topk(TOPK, dim=-1)
        pick = top_ids[:, 0].clone()
        rows_s = sampled_t[live]
        if rows_s.any():
            probs = torch.softmax(logits[rows_s] / temperature, dim=-1)
            pick[rows_s] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        keep = []
        for row, seq in enumerate(live):
            tok = int(pick[row])
            rec[seq]["tokens"].append(tok)
            rec[seq]["top_ids"].append(top_ids[row:row + 1])
            rec[seq]["top_p"].append(top_p[row:row + 1])
            if tok != eos and step < max_new - 1:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):
            idx = torch.tensor(keep)
            cache.batch_select_indices(idx)
            mask, pos, pick = mask[idx], pos[idx], pick[idx]
            live = [live[r] for r in keep]
        mask = torch.cat((mask, torch.ones(len(live), 1, dtype=mask.dtype)), dim=1)
        pos = pos[:, -1:] + 1
        out = model.model(input_ids=pick[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                          use_cache=True).last_hidden_state
        last = out[:, -1]
        for row, seq in enumerate(live):
            rec[seq]["hidden"].append(last[row:row + 1])
    seqs = []
    for i, r in enumerate(rec):
        hidden = torch.cat(r["hidden"])
        n = hidden.shape[0]  # fed positions: every token but the last picked
        top_ids, top_p = torch.cat(r["top_ids"]), torch.cat(r["top_p"])
        assert top_ids.shape[0] == n
        seqs.append(Sequence(torch.tensor(r["tokens"][:n]), hidden.half(), top_ids[:, 0].clone(), top_ids,
                             top_p.half(), len(prompts[i]), sampled[i]))
    return seqs


def load_main_model(gguf: Path | None = None):
    import transformers

    if gguf is None:
        from strata.model.loader import default_model_path

        gguf = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tok


def build_data(model, tokenizer, args, log=print) -> tuple[list[Sequence], list[Sequence]]:
    """Held-out answers (prompts on topics the training prompts never use) and training answers, about
    args.tokens tokens in all, half greedy and half sampled; cached under ~/.cache/strata-train/."""
    topics = sorted(TOPICS)
    random.Random(args.seed).shuffle(topics)
    n_held = max(1, len(topics) // 10)
    held_topics, train_topics = topics[:n_held], topics[n_held:]
    key = hashlib.sha256(json.dumps(dict(
        v=3, tokens=args.tokens, max_new=args.max_new, temperature=args.temperature, seed=args.seed,
        heldout=args.heldout, model=str(args.gguf_id), topics=topics)).encode()).hexdigest()[:16]
    path = CACHE / f"mtp-smollm2-{key}.pt"
    if path.exists() and not args.regenerate:
        log(f"data: cached {path}")
        data = torch.load(path, weights_only=False)
        return [_seq(x) for x in data["train"]], [_seq(x) for x in data["heldout"]]

    def encode(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()

    def run(prompts: list[str], sampled_flags: list[bool], budget: int | None, tag: str) -> list[Sequence]:
        out, total = [], 0
        for start in range(0, len(prompts), args.gen_batch):
            chunk = prompts[start:start + args.gen_batch]
            seqs = answer_batch(model, [encode(p) for p in chunk], sampled_flags[start:start + args.gen_batch],
                                args.max_new, args.temperature, eos, gen)
            out += seqs
            total += sum(len(s.tokens) for s in seqs)
            log(f"  {tag}: {len(out)} answers, {total} tokens, {time.time() - t0:.0f} s")
            if budget is not None and total >= budget:
                break
        return out

    held_prompts = make_prompts(args.heldout, args.seed + 1, held_topics)
    heldout = run(held_prompts, [i % 2 == 1 for i in range(len(held_prompts))], None, "held-out")
    train_prompts = make_prompts(4 * args.tokens // 200, args.seed + 2, train_topics)
    train = run(train_prompts, [i % 2 == 1 for i in range(len(train_prompts))], args.tokens, "train")
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save({"train": [vars(x) for x in train], "heldout": [vars(x) for x in heldout]}, path)
    log(f"data: {len(train)} training answers, {sum(len(s.tokens) for s in train)} tokens; {len(heldout)} held-out "
        f"({time.time() - t0:.0f} s), cached in {path}")
    return train, heldout


def _seq(x) -> Sequence:
    return x if isinstance(x, Sequence) else Sequence(**x)


def choose_draft_vocab(seqs: list[Sequence], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent tokens of the answers (and the main model's picks there), sorted ascending."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in seqs:
        a = s.prompt_len
        counts += torch.bincount(s.tokens[a:], minlength=vocab) + torch.bincount(s.greedy[a - 1:], minlength=vocab)
    return counts.topk(min(size, vocab)).indices.sort().values


# ----------------------------------------------------------------------------------------------------------------
# Training


@dataclass
class Batch:
    hidden: torch.Tensor  # [B, T, H] float32
    tokens: torch.Tensor  # [B, T]
    targets: list[torch.Tensor]  # per step j: [B, T-1] index into the draft vocab, -1: unscored, -2: outside vocab
    top_idx: list[torch.Tensor]  # per step: [B, T-1, TOPK] draft index of the teacher's top ids (-1 outside)
    top_p: list[torch.Tensor]    # per step: [B, T-1, TOPK]


def make_batch(seqs: list[Sequence], steps: int, vocab_index: torch.Tensor) -> Batch:
    """Row r's step-j target is y_{r+j}, the main model's pick for x_{r+j+1}; it is scored when x_{r+j+1} is an
    answer token and the chain is real: x_{r+i+1} == y_{r+i} for i = 1..j-1 (the earlier drafts, if accepted, are
    the tokens that follow in the text)."""
    b, t = len(seqs), max(len(s.tokens) for s in seqs)
    hidden = torch.zeros(b, t, seqs[0].hidden.shape[1])
    tokens = torch.zeros(b, t, dtype=torch.int64)
    targets = [torch.full((b, t - 1), -1, dtype=torch.int64) for _ in range(steps)]
    top_idx = [torch.full((b, t - 1, TOPK), -1, dtype=torch.int64) for _ in range(steps)]
    top_p = [torch.zeros(b, t - 1, TOPK) for _ in range(steps)]
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        hidden[i, :n] = s.hidden.float()
        tokens[i, :n] = s.tokens
        match = torch.zeros(n + 1, dtype=torch.bool)
        match[:n - 1] = s.tokens[1:] == s.greedy[:-1]  # match[p]: x_{p+1} == y_p
        r = torch.arange(n - 1)
        ok = torch.ones(n - 1, dtype=torch.bool)
        for j in range(1, steps + 1):
            if j > 1:
                ok &= match[(r + j - 1).clamp(max=n)]
            p = r + j  # target position
            valid = ok & (p <= n - 1) & (p >= s.prompt_len - 1)
            rows = r[valid]
            y = s.greedy[p[valid]]
            idx = vocab_index[y]
            targets[j - 1][i, rows] = torch.where(idx >= 0, idx, torch.full_like(idx, -2))
            top_idx[j - 1][i, rows] = vocab_index[s.top_ids[p[valid]]]
            top_p[j - 1][i, rows] = s.top_p[p[valid]].float()
    return Batch(hidden, tokens, targets, top_idx, top_p)


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
    outs = head.chain(batch.hidden, batch.tokens, len(weights))
    total, hits, counts = 0.0, [], []
    for j, (o, w) in enumerate(zip(outs, weights)):
        tgt = batch.targets[j]
        scored = tgt >= 0
        if not scored.any():
            hits.append(0)
            counts.append(0)
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
        hits.append(int((logp.argmax(-1) == tgt[scored]).sum()))
        counts.append(int(scored.sum()))
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
        b = make_batch(group, k, vocab_index)
        outs = head.chain(b.hidden, b.tokens, k)
        ok = torch.ones_like(b.targets[0], dtype=torch.bool)
        scored = torch.ones_like(ok)
        for j in range(k):
            scored &= b.targets[j] != -1
        for j in range(k):
            logits = head.logits(outs[j])
            if subset is not None:
                masked = torch.full_like(logits, float("-inf"))
                masked[..., subset] = logits[..., subset]
                logits = masked
            ok &= logits.argmax(-1) == b.targets[j]
            acc[j] += (ok & scored).sum()
        rows += int(scored.sum())
        outside += int((scored & (b.targets[0] == -2)).sum())
    per_pos = (acc / max(rows, 1)).tolist()
    return {"accept": per_pos, "rows": rows, "outside_vocab": outside / max(rows, 1),
            "mean_accepted": [sum(per_pos[:i + 1]) for i in range(k)]}


def _vocab_index(head: MtpHead) -> torch.Tensor:
    index = torch.full((head.embedding.shape[0],), -1, dtype=torch.int64)
    index[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    return index


def train_head(head: MtpHead, train: list[Sequence], heldout: list[Sequence], *, epochs: float, lr: float,
               batch_tokens: int, weights: list[float], soft: float, feat: float = 0.0, seed: int = 0, log=print,
               eval_every: int = 25, time_limit: float | None = None) -> list[dict]:
    """AdamW with a linear warm-up and a cosine decay; the main model's hidden states are inputs, the embedding
    is frozen. Returns the log (step, loss, held-out acceptance@1)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    vocab_index = _vocab_index(head)
    per_epoch = len(batches(train, batch_tokens, None))
    total = max(1, int(epochs * per_epoch))
    warm = max(1, min(40, total // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))))
    history, step, t0 = [], 0, time.time()
    run_loss, run_n, run_hits, run_counts = 0.0, 0, [0] * len(weights), [0] * len(weights)
    while step < total:
        for group in batches(train, batch_tokens, rng):
            head.train()
            loss, hits, counts = step_loss(head, make_batch(group, len(weights), vocab_index), weights, soft, feat)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            run_loss += float(loss.detach())
            run_n += 1
            run_hits = [a + b for a, b in zip(run_hits, hits)]
            run_counts = [a + b for a, b in zip(run_counts, counts)]
            last = step >= total or (time_limit is not None and time.time() - t0 > time_limit)
            if step % eval_every == 0 or last:
                entry = {"step": step, "loss": run_loss / run_n,
                         "train_acc": [h / max(c, 1) for h, c in zip(run_hits, run_counts)],
                         "time": time.time() - t0}
                if heldout:
                    entry["heldout_accept1"] = evaluate(head, heldout, k=1)["accept"][0]
                history.append(entry)
                log(f"step {step}/{total}  loss {entry['loss']:.3f}  train acc/step "
                    + " ".join(f"{a:.3f}" for a in entry["train_acc"])
                    + (f"  held-out acc@1 {entry['heldout_accept1']:.3f}" if heldout else "")
                    + f"  {entry['time']:.0f} s")
                run_loss, run_n, run_hits, run_counts = 0.0, 0, [0] * len(weights), [0] * len(weights)
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
    ap.add_argument("--ship-vocab", type=int, default=4096,
                    help="tokens the shipped head scores: the most frequent of the trained vocabulary")
    ap.add_argument("--from-head", type=Path, default=None,
                    help="a trained head file: evaluate it and write it with --ship-vocab tokens, no training")
    ap.add_argument("--epochs", type=float, default=5.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per training batch")
    ap.add_argument("--steps", type=str, default="1,0.5,0.25",
                    help="loss weight per chained step (as many steps as weights)")
    ap.add_argument("--soft", type=float, default=0.5, help="weight of the top-k soft-target cross-entropy")
    ap.add_argument("--feat", type=float, default=5.0,
                    help="weight of the smooth-L1 distance from the head's output to the main model's next hidden "
                         "state")
    ap.add_argument("--time-limit", type=float, default=None, help="stop training after this many seconds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.0f} s] {msg}", flush=True)

    model, tokenizer = load_main_model(args.gguf)
    src = args.gguf
    if src is None:
        from strata.model.loader import default_model_path

        src = default_model_path()
    args.gguf_id = f"{src.name}:{src.stat().st_size}"
    for p in model.parameters():
        p.requires_grad_(False)
    log("main model loaded")
    train, heldout = build_data(model, tokenizer, args, log)
    t_data = time.time() - t_start
    if args.data_only:
        return 0
    greedy_held = [s for s in heldout if not s.sampled]
    sampled_held = [s for s in heldout if s.sampled]
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in train)
    log(f"training answers: {len(train)}, {sum(len(s.tokens) for s in train)} tokens ({answer_tokens} answer tokens); "
        f"held-out: {len(greedy_held)} greedy + {len(sampled_held)} sampled answers")

    vocab = choose_draft_vocab(train, args.draft_vocab, model.config.vocab_size)
    weights = [float(w) for w in args.steps.split(",")]
    history: list[dict] = []
    if args.from_head:
        head = MtpHead.from_file(args.from_head, model.get_input_embeddings().weight)
        log(f"trained head from {args.from_head}: {len(head.draft_vocab)} draft tokens (no training)")
    else:
        sample = torch.cat([s.tokens for s in train[:4]])
        head = head_from_model(model, vocab, sample=sample)
        log(f"draft vocabulary: {len(vocab)} tokens; decoder layer from the main model's last, o_proj and down_proj "
            f"divided by {_residual_scale(model, -1, sample):.1f}")
        before = evaluate(head, greedy_held, k=4)
        log(f"before training: held-out acceptance per position {_fmt(before['accept'])}")
        history = train_head(head, train, greedy_held, epochs=args.epochs, lr=args.lr,
                             batch_tokens=args.batch_tokens, weights=weights, soft=args.soft, feat=args.feat,
                             seed=args.seed, log=log, time_limit=args.time_limit)
    del model
    t_train = time.time() - t_start - t_data

    # what ships: the bfloat16 weights (loaded back), scoring the `ship_vocab` most frequent tokens, a subset of
    # the trained vocabulary (the same weights; the drafts rarely are rarer tokens, so acceptance barely moves)
    tmp = args.out.with_suffix(".tmp")
    head.save(tmp)
    trained = MtpHead.from_file(tmp, head.embedding)
    tmp.unlink()
    ship = choose_draft_vocab(train, min(args.ship_vocab, len(trained.draft_vocab)), len(head.embedding))
    assert torch.isin(ship, trained.draft_vocab).all()
    shipped = MtpHead.from_file_tensors(trained.file_tensors() | {"mtp.draft_vocab": ship}, head.embedding,
                                        **trained.config())
    for name, h in (("trained", trained), ("shipped", shipped)):
        r = evaluate(h, greedy_held, k=4)
        log(f"{name} ({len(h.draft_vocab)} draft tokens), held-out greedy answers ({r['rows']} positions): "
            f"acceptance per position {_fmt(r['accept'])}, expected accepted drafts for K=1..4 "
            f"{_fmt(r['mean_accepted'])}, targets outside the draft vocabulary {r['outside_vocab']:.3f}")
    result = r
    sampled_result = evaluate(shipped, sampled_held, k=4)
    log(f"shipped, held-out sampled answers ({sampled_result['rows']} positions): {_fmt(sampled_result['accept'])} "
        f"(outside the draft vocabulary {sampled_result['outside_vocab']:.3f})")
    meta = {
        "base_model": "SmolLM2-135M-Instruct",
        "trained_by": "train/mtp_head.py",
        "acceptance_per_position": json.dumps([round(a, 4) for a in result["accept"]]),
        "acceptance_note": "held-out greedy answers to chat prompts on topics the training prompts never use; "
                           "position j counts only if positions < j were accepted; targets outside the draft "
                           "vocabulary count as misses",
        "acceptance_sampled_answers": json.dumps([round(a, 4) for a in sampled_result["accept"]]),
        "draft_vocab_outside_share": f"{result['outside_vocab']:.4f}",
        "hidden_input": "the main model's final hidden state after its final norm (what its LM head reads)",
        "training": json.dumps({"answers": len(train), "tokens": sum(len(s.tokens) for s in train),
                                "trained_vocab": len(trained.draft_vocab), "epochs": args.epochs, "lr": args.lr,
                                "step_weights": weights, "soft": args.soft, "feat": args.feat,
                                "batch_tokens": args.batch_tokens, "steps": history[-1]["step"] if history else None}),
    }
    if args.from_head:  # keep the training record of the file it came from
        from safetensors import safe_open

        with safe_open(str(args.from_head), framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("training", "{}"))
        record.setdefault("trained_vocab", len(trained.draft_vocab))
        meta["training"] = json.dumps(record)
    shipped.save(args.out, meta)
    log(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB); data {t_data:.0f} s, training {t_train:.0f} s, "
        f"total {time.time() - t_start:.0f} s")
    return 0


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


if __name__ == "__main__":
    raise SystemExit(main())
