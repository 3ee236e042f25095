"""The offline `LLM`, in this process, no server: a batch of prompts, one of them held to a
JSON schema (`StructuredOutputs`, vLLM's structured_outputs).

    python examples/offline_structured.py
"""

from __future__ import annotations

import json
import os

from cadenza import LLM, SamplingParams
from cadenza.structured_outputs import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}


def main() -> None:
    llm = LLM(os.environ.get("CADENZA_MODEL", "SmolLM2-135M-Instruct"))
    tok = llm.get_tokenizer()
    questions = ["What is the capital of France?", "Name a prime number."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    free = SamplingParams(temperature=0, max_tokens=24)
    shaped = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputs(json=SCHEMA))
    plain, structured = llm.generate(prompts, [free, shaped], use_tqdm=False)
    print(f"free: {plain.outputs[0].text!r}")
    print(f"json: {json.dumps(json.loads(structured.outputs[0].text))}")


if __name__ == "__main__":
    main()
