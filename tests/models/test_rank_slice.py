"""A worker's part read straight from the checkpoint (models/rank_slice.py) equals the whole
model loaded and then cut (shard_model), for every TP / PP layout; and reading only the part
keeps the worker's peak memory near the part's size, not the model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cadenza_testkit.tiny_models import TINY_CONFIGS

from cadenza.models.loader import load_model
from cadenza.models.shard import shard_model
from cadenza.models.tp import TPGroup
from cadenza.models.weights import ModelPart
from cadenza.weight_format import WeightFormat

FP32 = WeightFormat()
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 1)]  # (tensor_parallel_size, pipeline_parallel_size)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in [*model.named_parameters(), *model.named_buffers()]}


# qwen2_gqa_bias's 6 query heads over 2 KV heads cannot split 4 ways (models/tp.py refuses it).
# Mixture-of-experts models again with expert parallelism (whole experts per rank).
CASES = [
    (kind, tp, pp, False) for kind in sorted(TINY_CONFIGS) for tp, pp in LAYOUTS if (kind, tp) != ("qwen2_gqa_bias", 4)
] + [(kind, tp, pp, True) for kind in ("mixtral_moe", "qwen3_moe") for tp, pp in LAYOUTS if tp > 1]


@pytest.mark.parametrize("kind,tp,pp,ep", CASES)
def test_the_part_read_from_the_file_equals_the_whole_model_cut(
    tiny_model, kind: str, tp: int, pp: int, ep: bool
) -> None:
    path, _ = tiny_model(kind)
    for rank in range(tp):
        for stage in range(pp):
            group = TPGroup(rank, tp, None)
            whole = shard_model(load_model(str(path), FP32, "cpu").model, group, stage, pp, ep)
            part = load_model(str(path), FP32, "cpu", part=ModelPart(group, stage, pp, ep)).model
            expected, got = _state(whole), _state(part)
            assert got.keys() == expected.keys()
            for name, tensor in expected.items():
                assert not got[name].is_meta, name
                if tensor.shape == (1, 1):  # a stage's placeholder embedding / LM head: never read
                    continue
                assert torch.equal(got[name], tensor), f"rank {rank} stage {stage}: {name}"
            assert (part.vocab_start, part.is_first_stage, part.is_last_stage) == (
                whole.vocab_start,
                whole.is_first_stage,
                whole.is_last_stage,
            )
            heads = [(a.self_attn.num_heads, a.self_attn.num_kv_heads) for a in part.layers]
            assert heads == [(a.self_attn.num_heads, a.self_attn.num_kv_heads) for a in whole.layers]


PEAK = """
import json, sys, threading, time
import torch
from cadenza.models.loader import load_model
from cadenza.models.tp import TPGroup
from cadenza.models.weights import ModelPart
from cadenza.weight_format import WeightFormat

def anon():  # anonymous resident memory, bytes: the checkpoint's mmap'd file pages are not counted
    return 1024 * next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:"))

peak, done = [anon()], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
before = peak[0]
sampler = threading.Thread(target=sample)
sampler.start()
tp = int(sys.argv[2])
part = ModelPart(TPGroup(0, tp, None)) if tp > 1 else None
model = load_model(sys.argv[1], WeightFormat(), "cpu", part=part).model
done.set()
sampler.join()
held = sum(p.nbytes for p in model.parameters())
print(json.dumps({"peak_growth": max(peak[0], anon()) - before, "held": held}))
"""


@pytest.mark.heavy  # a process of its own, its peak memory measured
def test_a_rank_reads_its_slice_without_holding_the_whole_model(tmp_path: Path) -> None:
    """A 190 MB model: rank 0 of 4 grows by about its quarter plus one tensor being read."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    whole = sum(p.nbytes for p in transformers.LlamaForCausalLM(config).parameters())

    def measure(tp: int) -> dict[str, int]:
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path), str(tp)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    full, quarter = measure(1), measure(4)
    assert quarter["held"] < whole / 3 and full["held"] == whole
    # Peak growth from the RSS before loading: the whole model shows itself; rank 0 of 4 its
    # quarter plus about one tensor being read (the largest is the 65 MB embedding).
    assert full["peak_growth"] > 0.9 * whole, full
    assert quarter["peak_growth"] < quarter["held"] + 2 * 32000 * 512 * 4 < 0.8 * whole, quarter
