"""Structured outputs in the engine: every reply matches its grammar, with a random-weight
model (so it is the mask, not the model, that makes it valid), under n-gram speculation,
seeded sampling and preemption; and the matchers' bookkeeping on its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.actors.grammar_matchers import GrammarError, GrammarMatchers, GrammarQuery
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.structured_outputs import StructuredOutputs

# Every string and number bounded, so a valid document has a bounded length and a model
# that never chooses to close it is closed by the mask.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
CALL_GRAMMAR = 'start: "call " NUM\nNUM: /[1-9][0-9]?/'
PROMPTS = [f"Record {i}: describe a person with id {i * 7} as JSON." for i in range(20)]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama with SmolLM2's tokenizer (49k tokens, EOS <|im_end|> = 2)."""
    import transformers

    directory = tmp_path_factory.mktemp("random_smol_vocab")
    tokenizer = load_tokenizer(*read_model(DEFAULT_MODEL))
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    (directory / "tokenizer.json").write_text(tokenizer.backend.to_str())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    return directory


def _json_replies(llm: LLM, params: SamplingParams) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def _assert_valid(replies: list[str], schema: dict) -> None:
    for text in replies:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_model_json_always_valid(random_model: Path, temperature: float) -> None:
    llm = LLM(str(random_model), num_blocks=256)
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=200, structured_outputs=StructuredOutputs(json=PERSON)
    )
    replies = _json_replies(llm, params)
    _assert_valid(replies, PERSON)
    free = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=30))
    assert all(not _parses(o.outputs[0].text) for o in free)  # unconstrained, it is noise


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def test_random_model_json_valid_under_ngram_speculation(random_model: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(str(random_model), num_blocks=256, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputs(json=PERSON))
    replies = _json_replies(llm, params)
    _assert_valid(replies, PERSON)
    plain = LLM(str(random_model), num_blocks=256)
    assert replies == _json_replies(plain, params)  # greedy: speculation changes nothing
    assert llm.stats().spec_decode.num_draft_tokens > 0


def test_json_survives_preemption(random_model: Path) -> None:
    llm = LLM(str(random_model), num_blocks=56, block_size=4, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputs(json=PERSON))
    replies = _json_replies(llm, params)
    assert llm.stats().num_preemptions > 0
    _assert_valid(replies, PERSON)
    assert replies == _json_replies(LLM(str(random_model), num_blocks=512), params)


def test_regex_choice_and_grammar_on_smollm(smollm) -> None:
    prompt = smollm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Give me a phone number."}])
    cases = [
        (StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputs(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (
            StructuredOutputs(grammar='start: "call " NUM\nNUM: /[1-9][0-9]?/'),
            lambda t: re.fullmatch(r"call [1-9][0-9]?", t),
        ),
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, ok in cases:
        out = smollm.generate([prompt], SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec))[0]
        assert ok(out.outputs[0].text), (spec, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"json": {"type": "objectz"}}, "invalid JSON schema"),
        ({"regex": "a(b"}, "invalid regex"),
        ({"json": "{not json"}, "not JSON"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "at least one"),
        ({"grammar": "start: ("}, "invalid grammar"),
    ],
)
def test_bad_grammars_are_refused_when_made(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


@pytest.fixture(scope="module")
def matchers() -> GrammarMatchers:
    tokenizer = load_tokenizer(*read_model(DEFAULT_MODEL))
    return GrammarMatchers(tokenizer, tokenizer.eos_token_ids, overlap=False)


def _choice_params() -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputs(choice=["yes", "no"]))


def _ids(text: str) -> list[int]:
    return load_tokenizer(*read_model(DEFAULT_MODEL)).encode(text, add_special_tokens=False)


def test_matcher_follows_outputs_and_rolls_back(matchers: GrammarMatchers) -> None:
    yes, no = _ids("yes"), _ids("no")
    params = _choice_params()
    first = matchers.masks([GrammarQuery("r", params, [])])["r"][0]
    assert first[yes[0]] and first[no[0]] and first.sum() < 20
    done = matchers.masks([GrammarQuery("r", params, yes)])["r"][0]
    assert done.nonzero().flatten().tolist() == [2]  # complete: only EOS
    back = matchers.masks([GrammarQuery("r", params, no)])["r"][0]  # a different history: rolled back
    assert back.nonzero().flatten().tolist() == [2]
    bad = matchers.masks([GrammarQuery("x", params, _ids("maybe"))])["x"]
    assert isinstance(bad, GrammarError)


def test_draft_masks_stop_at_the_first_refused_draft(matchers: GrammarMatchers) -> None:
    params = _choice_params()
    yes = _ids("yes")
    masks = matchers.masks([GrammarQuery("d", params, [], [yes[0], 2, 5])])["d"]
    assert len(masks) == 4
    assert masks[1].nonzero().flatten().tolist() == [2]  # after "yes": EOS alone (which ends it)
    refused = matchers.masks([GrammarQuery("e", params, [], [5, yes[0]])])["e"]
    assert not refused[0][5] and len(refused) == 3  # draft 5 is refused, so rejected there
    again = matchers.masks([GrammarQuery("d", params, [])])["d"][0]  # drafts were rolled back
    assert torch.equal(again, masks[0])


def test_json_valid_scheduling_ahead(random_model: Path) -> None:
    """Async scheduling: the runner's matchers advance on its own samples, so the masks of the
    step planned before those tokens reached the scheduler are still right."""
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputs(json=PERSON))
    ahead = LLM(str(random_model), num_blocks=256, async_scheduling=True)
    replies = [o.outputs[0].text for o in ahead.generate(PROMPTS[:6], params)]
    _assert_valid(replies, PERSON)
    plain = LLM(str(random_model), num_blocks=256)
    assert replies == [o.outputs[0].text for o in plain.generate(PROMPTS[:6], params)]
