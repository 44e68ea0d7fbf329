"""A Hugging Face folder's tokenizer.json, tokenizer_config.json and chat template, against transformers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from strata.errors import CheckpointError
from strata.model.tokenizer import Tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXTS = ["hello world", "  spaced   out\n\nlines", "naïve café 123", "<|user|>hi</s>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox", "spaced out lines of café text"] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"}, "add_bos_token": True, "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return folder


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


def test_encode_decode_match_transformers(folder, reference):
    ours = Tokenizer.from_folder(folder)
    assert ours.bos_token_id == reference.bos_token_id and ours.eos_token_id == reference.eos_token_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id
        assert ids[1:] == reference(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids[1:]) == reference.decode(ids[1:])


def test_chat_template_matches_transformers(folder, reference):
    ours = Tokenizer.from_folder(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " hello world "}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.stop_ids == {ours.eos_token_id}


def test_no_tokenizer_and_broken_tokenizer(tmp_path):
    assert Tokenizer.from_folder(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


THINKING = (  # Qwen3's switch, as its template writes it: an empty think block when thinking is off
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(folder, reference):
    """A chat request's `chat_template_kwargs` (vLLM's field) are more variables of the template: the prompt is the
    one transformers renders with the same keywords; a variable Strata sets itself is refused by name."""
    from serve.errors import APIError
    from serve.requests import chat_prompt
    from serve.schemas import ChatCompletionRequest

    ours = Tokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), chat_template=THINKING)
    messages = [{"role": "user", "content": "hello world"}]
    for kwargs in [None, {"enable_thinking": False}, {"enable_thinking": True}]:
        body = ChatCompletionRequest(messages=messages, chat_template_kwargs=kwargs)
        want = reference.apply_chat_template(messages, chat_template=THINKING, add_generation_prompt=True,
                                             tokenize=False, **(kwargs or {}))
        assert chat_prompt(body, ours) == reference(want, add_special_tokens=False)["input_ids"]
        assert ("<think>" in want) == (kwargs == {"enable_thinking": False})
    with pytest.raises(APIError, match="chat_template_kwargs: 'add_generation_prompt' is a variable Strata gives"):
        chat_prompt(ChatCompletionRequest(messages=messages, chat_template_kwargs={"add_generation_prompt": False}),
                    ours)


@pytest.mark.parametrize("template", [TEMPLATE, THINKING], ids=["trims", "keeps-spaces"])
def test_continue_final_message_leaves_the_last_message_open_as_transformers_does(folder, reference, template):
    """vLLM's `continue_final_message` (with add_generation_prompt false): the prompt ends with the last message's
    text, not its end of turn, as transformers renders it; both on, or nothing to continue, refused by name."""
    from serve.errors import APIError
    from serve.requests import chat_prompt
    from serve.schemas import ChatCompletionRequest

    ours = Tokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), chat_template=template,
                     bos_token="<s>", eos_token="</s>")
    for last in ["The quick brown", "The quick brown ", " spaced out\n"]:
        messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": last}]
        body = ChatCompletionRequest(messages=messages, add_generation_prompt=False, continue_final_message=True)
        want = reference.apply_chat_template(messages, chat_template=template, add_generation_prompt=False,
                                             continue_final_message=True, tokenize=False)
        assert want.rstrip().endswith(last.strip()) and chat_prompt(body, ours) == reference(
            want, add_special_tokens=False)["input_ids"], want
    with pytest.raises(APIError, match="set add_generation_prompt to false too"):
        chat_prompt(ChatCompletionRequest(messages=messages, continue_final_message=True), ours)
    empty = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": " "}]
    with pytest.raises(APIError, match="no text to continue"):
        chat_prompt(ChatCompletionRequest(messages=empty, add_generation_prompt=False, continue_final_message=True),
                    ours)
