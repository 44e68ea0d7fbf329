"""The OpenAI surface agent clients use, against a real `strata serve` on the embedded default (the shared
`server` fixture), through the official `openai` SDK and plain HTTP: logprobs, n samples, /tokenize and
/detokenize, X-Request-Id, continuous usage in streams, and fields Strata refuses rather than ignores."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from strata.model.loader import ModelFiles

    return ModelFiles.open("default").tokenizer


def reference_steps(model, ids: list[int], steps: int) -> list[torch.Tensor]:
    """transformers' log-softmax of the logits at each greedy step after `ids`."""
    out = []
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            out.append(row)
            ids.append(int(row.argmax()))
    return out


def test_chat_logprobs_are_transformers_log_softmax_streamed_or_not(client, server, tokenizer, hf_default_model):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    for entry, ref in zip(content, reference_steps(hf_default_model, ids, 6)):
        values, top = ref.topk(3)
        assert entry.token == tokenizer.token_bytes(int(top[0])).decode()
        assert entry.bytes == list(tokenizer.token_bytes(int(top[0])))
        assert entry.logprob == pytest.approx(float(values[0]), abs=2e-3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.token_bytes(int(t)).decode() for t in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=2e-3)
    assert "".join(e.token for e in content) == whole.choices[0].message.content

    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    # The first request read the prompt in a prompt window; the streamed one found it parked and ran only its last
    # token again, in a window of another shape, so its rows may round differently (by up to 6e-4 on one CI CPU,
    # 1e-6 here): against transformers it is held to the same tolerance as the first. A third request, not streamed,
    # finds the prompt parked the same way, so the streamed values must be its values exactly.
    again = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [e.logprob for e in streamed] == [e.logprob for e in again]
    assert [[t.logprob for t in e.top_logprobs] for e in streamed] == [[t.logprob for t in e.top_logprobs]
                                                                     for e in again]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=2e-3)


def test_completion_logprobs_tokens_offsets_and_top(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and value <= 0
        assert top[chosen] == pytest.approx(value)  # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(value)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, server, tokenizer, hf_default_model):
    """A completion's `echo` with `logprobs` (what lm-evaluation-harness sends for loglikelihood tasks): each prompt
    token after the first with transformers' log-softmax of the logits before it, and the top ones; the first has
    none; then the answer's tokens as without echo; streamed, the same prompt entries in the first chunk."""
    prompt = "The capital of France is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=2)
    r = client.completions.create(**kw, echo=True)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.token_bytes(i).decode() for i in ids] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    want = [float(ref[p - 1, ids[p]]) for p in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=2e-3)
    for p in range(1, n):
        values, top = ref[p - 1].topk(2)
        assert list(lp.top_logprobs[p]) == [tokenizer.token_bytes(int(t)).decode() for t in top]
        assert list(lp.top_logprobs[p].values()) == pytest.approx(values.tolist(), abs=2e-3)
    plain = client.completions.create(**kw).choices[0]
    assert r.choices[0].text == prompt + plain.text and lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_n_seeded_samples_differ_from_each_other_and_repeat(client):
    kw = dict(model=MODEL, prompt="Write a word:", max_tokens=12, temperature=1.0, seed=11)
    first = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert [c.text for c in sorted(client.completions.create(n=3, **kw).choices, key=lambda c: c.index)] == texts
    assert client.completions.create(**kw).choices[0].text == texts[0]  # sample 0 is the request's own seed
    assert first.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in client.completions.create(n=3, logprobs=0, **kw).choices)

    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == texts


def _prefix_cache_hits(server) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Accept": "text/plain"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_n_samples_share_one_read_of_their_prompt(server, client):
    """The samples go to the engine in one write and are admitted together: one slot reads the prompt, the others
    take their first token from its last row and a copy of its state (prefix-cache hits of the whole prompt)."""
    before = _prefix_cache_hits(server)
    answer = client.completions.create(model=MODEL, prompt="Three rivers that cross a capital city are", n=4,
                                       max_tokens=6, temperature=1.0, seed=5)
    assert len(answer.choices) == 4
    assert _prefix_cache_hits(server) - before >= 3 * answer.usage.prompt_tokens


def test_tokenize_and_detokenize(server, tokenizer):
    text = "Hello, naïve world"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert "".join(r["token_strs"]) == text and r["max_model_len"] > 0
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES)
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    both = httpx.post(server.url + "/tokenize", json={"prompt": "a", "messages": MESSAGES})
    assert both.status_code == 400 and "either prompt or messages" in both.json()["error"]["message"]


def test_request_id_is_echoed_and_usage_can_come_with_every_chunk(server):
    body = {"model": MODEL, "prompt": "One two three", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42"}) as r:
        assert r.headers["x-request-id"] == "trace-42"
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and seen == sorted(seen) and seen[-1] == 5
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       headers={"X-Request-Id": "trace-43"})
    assert plain.headers["x-request-id"] == "trace-43" and plain.json()["usage"]["completion_tokens"] == 5


def test_logit_bias_bans_and_forces_tokens(client, server, tokenizer, hf_default_model):
    """A -100 bias on the greedy first token gives transformers' second choice there; +100 on a token, sampled, gives
    it every time; a key that is not a token id is refused by name."""
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    first, second = reference_steps(hf_default_model, ids, 1)[0].topk(2).indices.tolist()
    banned = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
                                            logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.content[0].token == tokenizer.token_bytes(second).decode()
    comma = tokenizer.encode(",")[-1]
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=1.0, seed=5,
                                       logit_bias={str(comma): 100})
    assert forced.choices[0].text == "," * 4
    for bad, words in [({"blue": 1}, "logit_bias: key 'blue' is not a token id"), ({"5": 101}, "logit_bias.5"),
                       ({str(10**9): 1}, "is not a token id")]:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "logit_bias": bad})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_min_tokens_keeps_the_answer_going_past_its_stops(client, server):
    """vLLM's `min_tokens`: the greedy answer ends with the end-of-turn token as its 8th; with min_tokens 12
    it goes on (the stop token is banned until then: the first 7 tokens are the same) and a stop string met before
    the 12th token does not end it either, streamed or not; min_tokens above max_tokens is refused by name."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, logprobs=True)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and n < 12, plain
    longer = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0, logprobs=True,
                                            extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    said = [t.token for t in plain.choices[0].logprobs.content]  # its last: the end-of-turn token, now banned there
    assert [t.token for t in longer.choices[0].logprobs.content[:n]][: n - 1] == said[: n - 1] != said
    text = plain.choices[0].message.content
    assert longer.choices[0].message.content.startswith(text) and len(longer.choices[0].message.content) > len(text)
    stop = text[-1]  # the answer's last character, met before the 12th token
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ask, max_tokens=40, temperature=0, stop=[stop], extra_body={"min_tokens": 12})
        if stream:
            got = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                          if c.choices)
        else:
            got = client.chat.completions.create(**kw).choices[0].message.content
        assert got.startswith(text) and len(got) > len(text), (stream, got)
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": ask, "max_tokens": 4, "min_tokens": 5})
    assert bad.status_code == 400 and "min_tokens (5) is more than max_tokens (4)" in bad.json()["error"]["message"]


def test_continue_final_message_prefills_the_answer(server, client):
    """vLLM's assistant prefill: the answer continues the last message's text (and is only the continuation), the
    prompt being the chat without that message's end of turn (/tokenize gives the same ids)."""
    ask = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3, temperature=0, extra_body=extra)
    assert r.choices[0].message.content.startswith(" Paris"), r.choices[0].message.content
    ids = httpx.post(server.url + "/tokenize", json={"messages": ask, **extra}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    closed = httpx.post(server.url + "/tokenize", json={"messages": ask, "add_generation_prompt": False}).json()
    assert closed["tokens"][: len(ids)] == ids and len(closed["tokens"]) > len(ids)


def test_stop_text_and_special_tokens_as_vllm_gives_them(client, tokenizer):
    """An answer ended by a stop token (the end of turn, or `stop_token_ids`) or a stop string holds neither, unless
    `include_stop_str_in_output`; `skip_special_tokens` false keeps special tokens' text in the answer."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    def chat(max_tokens=20, extra=None, **kw):
        return client.chat.completions.create(model=MODEL, messages=ask, max_tokens=max_tokens, temperature=0,
                                              extra_body=extra, **kw).choices[0].message.content

    assert chat() == "The capital of France is Paris."
    dot = tokenizer.encode(".", add_special_tokens=False)
    assert chat(extra={"stop_token_ids": dot}) == "The capital of France is Paris"
    assert chat(extra={"stop_token_ids": dot, "include_stop_str_in_output": True}) == "The capital of France is Paris."
    assert chat(stop=[" is"]) == "The capital of France"
    assert chat(stop=[" is"], extra={"include_stop_str_in_output": True}) == "The capital of France is"
    end = tokenizer.token_bytes(min(tokenizer.stop_ids)).decode()  # <|im_end|>
    assert chat(extra={"skip_special_tokens": False}) == "The capital of France is Paris."  # (its stop token: not text)
    assert chat(extra={"skip_special_tokens": False, "include_stop_str_in_output": True}).endswith("Paris." + end)
    on = chat(max_tokens=12, extra={"ignore_eos": True, "skip_special_tokens": False})
    off = chat(max_tokens=12, extra={"ignore_eos": True})
    assert on.startswith("The capital of France is Paris." + end) and end not in off, (on, off)


def test_chat_template_kwargs_pass_through_http(server, client):
    """vLLM's `chat_template_kwargs` through /tokenize and a chat request (the default's template reads no such
    variable: the same prompt; tests/test_tokenizer.py checks one that does against transformers); a variable
    Strata sets itself is refused by name."""
    tokenize = lambda **kw: httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, **kw}).json()  # noqa: E731
    assert tokenize(chat_template_kwargs={"enable_thinking": False})["tokens"] == tokenize()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens == 2
    bad = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                                                               "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and "chat_template_kwargs: 'messages' is a variable" in bad.json()["error"]["message"]


@pytest.mark.parametrize("extra, words", [
    ({"prediction": {"type": "content", "content": "x"}}, "prediction: Strata does not support this field"),
    ({"top_logprobs": 2}, "set logprobs to true"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {}}]}, "messages.0.audio"),
    ({"stream_options": {"include_usage": True, "unknown": 1}}, "stream_options.unknown"),
])
def test_fields_strata_does_not_honour_are_refused_by_name(server, extra, words):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_fields_that_change_nothing_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="u1", store=False,
                                       metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].message.content is not None
