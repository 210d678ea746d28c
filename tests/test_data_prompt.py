"""Prompt formats reproduce the target's chat template token for token; the loss mask is the reply only."""

import pytest
from lhotse import Recording

from dflash_train.data.conversation import Conversation, DataError, Turn
from dflash_train.data.prompt import build_prompt_format
from dflash_train.errors import ConfigError

TAG = "<|audio|>"


@pytest.fixture(scope="module")
def audio_cut(speech_files):
    return Recording.from_file(str(speech_files["utt-short"])).to_cut()


@pytest.fixture(scope="module")
def tok(tiny_target):
    return tiny_target.tokenizer


def _asr(audio_cut, reply="hello world, the quick brown fox.", system="Be brief.", context="Transcribe:"):
    turns = [Turn("system", text=system)] if system else []
    turns += [Turn("user", text=context)] if context else []
    turns += [Turn("user", audio=audio_cut), Turn("assistant", text=reply, supervised=True)]
    return Conversation("utt-1", turns)


def _chat(fmt, conversation):
    return [{"role": m.role, "content": m.content} for m in fmt.messages(conversation)]


def test_qwen_matches_the_tokenizer_chat_template_and_supervises_from_the_generation_prompt(tok, audio_cut):
    fmt = build_prompt_format("qwen", tok, TAG)
    conversation = _asr(audio_cut)
    encoded = fmt.encode(conversation)
    chat = _chat(fmt, conversation)
    assert chat[1] == {"role": "user", "content": "Transcribe: <|audio|>"}  # context and audio form one message
    hf = tok.tokenizer
    full = list(hf.apply_chat_template(chat, tokenize=True)["input_ids"])
    prompt = list(hf.apply_chat_template(chat[:-1], tokenize=True, add_generation_prompt=True)["input_ids"])
    assert encoded.input_ids.tolist() == full
    # Supervised: exactly what the target generates after the generation prompt, up to and including
    # <|im_end|>; the template's trailing newline is not.
    expected = [False] * len(prompt) + [True] * (len(full) - len(prompt) - 1) + [False]
    assert encoded.loss_mask.tolist() == expected
    assert hf.decode(encoded.input_ids[encoded.loss_mask]) == "hello world, the quick brown fox.<|im_end|>"
    assert (encoded.input_ids == fmt.audio_locator_tag_id).sum() == 1


def test_qwen_matches_nemo_qwen_prompt_formatter(tok, audio_cut):
    from nemo.collections.common.prompts.qwen import QwenPromptFormatter

    fmt = build_prompt_format("qwen", tok, TAG)
    conversation = _asr(audio_cut, system=None)
    turns = [{"role": m.role, "slots": {"message": m.content}} for m in fmt.messages(conversation)]
    reference = QwenPromptFormatter(tok).encode_dialog(turns)["input_ids"].tolist()
    assert fmt.encode(conversation).input_ids.tolist() == reference


def test_nemotron_nano_v3_matches_nemo_and_leaves_the_empty_think_block_unsupervised(tok, audio_cut):
    from nemo.collections.common.prompts.nemotron_nano_v3 import NemotronNanoV3PromptFormatter

    fmt = build_prompt_format("nemotron_nano_v3", tok, TAG)
    conversation = _asr(audio_cut, reply="  hello world.  ", system=None)
    encoded = fmt.encode(conversation)
    turns = [{"role": m.role, "slots": {"message": m.content}} for m in fmt.messages(conversation)]
    assert turns[0] == {"role": "system", "slots": {"message": ""}}  # inserted, as the template does
    assert encoded.input_ids.tolist() == NemotronNanoV3PromptFormatter(tok).encode_dialog(turns)["input_ids"].tolist()
    hf = tok.tokenizer
    text = hf.decode(encoded.input_ids)
    assert text.endswith("<|im_start|>assistant\n<think></think>hello world.<|im_end|>\n")
    first = int(encoded.loss_mask.nonzero()[0][0])
    assert hf.convert_ids_to_tokens(int(encoded.input_ids[first - 1])) == "</think>"
    assert hf.decode(encoded.input_ids[encoded.loss_mask]) == "hello world.<|im_end|>"


@pytest.mark.parametrize("name", ["qwen", "nemotron_nano_v3"])
def test_multi_turn_supervises_exactly_the_chosen_replies(tok, audio_cut, name):
    fmt = build_prompt_format(name, tok, TAG)
    conversation = Conversation(
        "chat-1",
        [
            Turn("user", audio=audio_cut),
            Turn("assistant", text="first answer", supervised=False),
            Turn("user", text="and then?"),
            Turn("assistant", text="second answer", supervised=True),
        ],
    )
    encoded = fmt.encode(conversation)
    hf = tok.tokenizer
    assert hf.decode(encoded.input_ids[encoded.loss_mask]) == "second answer<|im_end|>"
    conversation.turns[1].supervised = True
    both = fmt.encode(conversation)
    assert both.input_ids.tolist() == encoded.input_ids.tolist()
    assert hf.decode(both.input_ids[both.loss_mask]) == "first answer<|im_end|>second answer<|im_end|>"
    # Token by token: every supervised token lies inside a reply, every reply token is supervised.
    runs = []
    for i, flag in enumerate(both.loss_mask.tolist()):
        if flag and (not runs or runs[-1][1] != i):
            runs.append([i, i + 1])
        elif flag:
            runs[-1][1] = i + 1
    assert [hf.decode(both.input_ids[a:b]) for a, b in runs] == ["first answer<|im_end|>", "second answer<|im_end|>"]


def test_a_text_turn_containing_the_audio_tag_is_an_error_naming_the_sample(tok, audio_cut):
    fmt = build_prompt_format("qwen", tok, TAG)
    bad = _asr(audio_cut, context=f"Listen {TAG} carefully:")
    message = r"sample 'utt-1' has 2 audio placeholder\(s\) '<\|audio\|>' in its tokens but 1 audio"
    with pytest.raises(DataError, match=message):
        fmt.encode(bad)


def test_bad_format_name_and_multi_token_tag_are_config_errors(tok):
    with pytest.raises(ConfigError, match="data.prompt_format='llama' is unknown; choose one of"):
        build_prompt_format("llama", tok, TAG)
    with pytest.raises(ConfigError, match="model.audio_locator_tag='<audio>' is .* tokens"):
        build_prompt_format("qwen", tok, "<audio>")
