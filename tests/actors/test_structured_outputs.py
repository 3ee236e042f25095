"""Structured outputs in the engine: every reply matches its grammar, with a random-weight
model (so it is the mask, not the model, that makes it valid), under n-gram speculation,
seeded sampling and preemption; and the matchers' bookkeeping on its own."""

from __future__ import annotations

import json
import re
import threading
import uuid
from pathlib import Path

import jsonschema
import pytest
import torch

import cadenza.structured_outputs as structured_outputs
from cadenza import LLM, SamplingParams
from cadenza.actors.grammar_matchers import GrammarError, GrammarMatchers, GrammarQuery
from cadenza.messages import EngineRequest
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
        ({"json": "{not json"}, "not JSON"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "at least one"),
    ],
)
def test_malformed_grammars_are_refused_when_made(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"json": {"type": "objectz"}}, "invalid JSON schema"),
        ({"regex": "a(b"}, "invalid regex"),
        ({"grammar": "start: ("}, "invalid grammar"),
    ],
)
def test_grammars_compile_on_check_not_when_made(fields: dict, message: str, monkeypatch) -> None:
    """Made while msgspec decodes a request body (on the gateway's loop): nothing compiles
    there; check() compiles, and LLM.generate refuses before any work."""
    compiles = _count_compiles(monkeypatch)
    spec = StructuredOutputs(**fields)
    assert compiles == []
    with pytest.raises(ValueError, match=message):
        spec.check()
    assert len(compiles) == 1


def _count_compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    compiles: list[str] = []
    real = structured_outputs.validate_grammar
    monkeypatch.setattr(structured_outputs, "validate_grammar", lambda g: compiles.append(g) or real(g))
    return compiles


def test_a_repeated_grammar_is_compiled_once_whatever_asked_for_it(monkeypatch) -> None:
    compiles = _count_compiles(monkeypatch)
    regex = f"id-{uuid.uuid4().hex}-[0-9]{{3}}"  # new to this process's verdict cache
    for source in ("response_format", "guided_regex", "structured_outputs"):
        StructuredOutputs(regex=regex, source=source).check()
    assert len(compiles) == 1
    bad = f"({uuid.uuid4().hex}"
    for source in ("guided_regex", "structured_outputs"):  # a refusal names its own source
        with pytest.raises(ValueError, match=f"^{source}: invalid regex"):
            StructuredOutputs(regex=bad, source=source).check()
    assert len(compiles) == 2


@pytest.fixture(scope="module")
def matchers() -> GrammarMatchers:
    tokenizer = load_tokenizer(*read_model(DEFAULT_MODEL))
    return GrammarMatchers(lambda: tokenizer, tokenizer.eos_token_ids, overlap=False)


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


class _Gate:
    entered: threading.Event  # a slow mask has begun
    opened: threading.Event  # slow masks may end

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()


def _count_engine_compiles(
    monkeypatch: pytest.MonkeyPatch, slow_regex: str = "", gate: _Gate | None = None
) -> list[str]:
    """Counts GrammarMatchers' compiles; the grammar slow_regex compiles to a matcher whose
    masks wait until `gate` opens."""
    compiles: list[str] = []
    real = GrammarMatchers._compile

    def compile_counted(self: GrammarMatchers, spec: StructuredOutputs):  # noqa: ANN202
        compiles.append(spec.digest())
        matcher = real(self, spec)
        return _SlowMatcher(matcher, gate) if spec.regex == slow_regex else matcher

    monkeypatch.setattr(GrammarMatchers, "_compile", compile_counted)
    return compiles


class _SlowMatcher:
    """An LLMatcher whose masks are never ready until `gate` opens: a grammar too slow for
    its step."""

    def __init__(self, inner, gate: _Gate) -> None:  # noqa: ANN001
        self.inner, self.gate = inner, gate

    def deep_copy(self) -> _SlowMatcher:
        return _SlowMatcher(self.inner.deep_copy(), self.gate)

    def compute_bitmask(self) -> bytes:
        self.gate.entered.set()
        self.gate.opened.wait()
        return self.inner.compute_bitmask()

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_n_children_share_one_compile(matchers: GrammarMatchers, monkeypatch) -> None:
    compiles = _count_engine_compiles(monkeypatch)
    regex = f"n-{uuid.uuid4().hex[:8]}-[0-9]{{2}}"
    # Each child arrives with its own copy of the params (decoded from its own EngineRequest).
    queries = [
        GrammarQuery(f"n-{i}", SamplingParams(structured_outputs=StructuredOutputs(regex=regex)), []) for i in range(3)
    ]
    masks = matchers.masks(queries)
    assert all(isinstance(m, list) for m in masks.values())
    assert len(compiles) == 1
    matchers.masks([GrammarQuery("later", SamplingParams(structured_outputs=StructuredOutputs(regex=regex)), [])])
    assert len(compiles) == 1  # a later request with the same grammar copies the compiled one
    for q in queries:
        matchers.drop(q.req_id)


def test_a_slow_mask_fails_its_own_request_and_the_step_goes_on(matchers: GrammarMatchers, monkeypatch) -> None:
    slow, gate = f"slow-{uuid.uuid4().hex[:8]}", _Gate()
    _count_engine_compiles(monkeypatch, slow, gate)
    timed = GrammarMatchers(matchers._load_tokenizer, matchers._eos, overlap=True, mask_timeout_s=0.05)
    timed.lltokenizer = matchers.lltokenizer  # built once per test module
    params = {
        name: SamplingParams(structured_outputs=StructuredOutputs(regex=r))
        for name, r in (("slow", slow), ("fast", "[a-z]+"))
    }
    try:
        pending = timed.start([GrammarQuery("slow", params["slow"], []), GrammarQuery("fast", params["fast"], [])])
        assert gate.entered.wait(timeout=60)  # the thread is in the slow mask
        step = timed.join(pending)
        assert isinstance(step["slow"], GrammarError) and "grammar_mask_timeout_s" in str(step["slow"])
        assert isinstance(step["fast"], list)  # not reached by the stuck thread: computed inline
        again = timed.join(timed.start([GrammarQuery("fast", params["fast"], _ids("abc"))]))  # a fresh thread
        assert isinstance(again["fast"], list) and again["fast"][0].sum() > 0
    finally:
        gate.opened.set()


@pytest.mark.heavy  # waits out the grammar deadline
def test_a_slow_grammar_fails_alone_in_the_engine(random_model: Path, monkeypatch) -> None:
    """In the engine: the slow request ends with the time box's error; a plain request and
    another grammar's, sampled in the same steps, complete."""
    slow, gate = f"slow-{uuid.uuid4().hex[:8]}", _Gate()
    _count_engine_compiles(monkeypatch, slow, gate)
    llm = LLM(str(random_model), num_blocks=256, grammar_mask_timeout_s=1.0)
    grammars = {"slow": StructuredOutputs(regex=slow), "choice": StructuredOutputs(choice=["yes", "no"]), "plain": None}
    # The vocabulary's index and the choice's grammar built first, outside the time box.
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, structured_outputs=grammars["choice"]), use_tqdm=False)
    try:
        for name, grammar in grammars.items():
            params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar)
            llm.engine.add_request(
                EngineRequest(request_id=name, prompt_token_ids=_ids(PROMPTS[0]), sampling_params=params)
            )
        ended = {}
        while llm.engine.has_unfinished():
            ended |= {out.request_id: out for out in llm.engine.step() if out.finish_reason}
        assert ended["slow"].finish_reason == "error" and "grammar_mask_timeout_s" in ended["slow"].error
        assert ended["plain"].finish_reason == "length" and ended["choice"].finish_reason == "stop"
    finally:
        gate.opened.set()
