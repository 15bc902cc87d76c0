"""A step reads the device once: every chunk's token, error flag and logprobs come back in
one read, and the step's inputs go up in one upload, packed into one buffer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.core import model_runner
from engine.core.staging import pack, tensors, unpack
from tests.host_syncs import HostReads

KINDS = [SamplingParams(max_tokens=8, ignore_eos=True),
         SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=20),
         SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, seed=3, logprobs=2,
                        repetition_penalty=1.2, min_p=0.05, logit_bias=((5, 2.0),))]


CUDA = pytest.param("cuda", "auto", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


def _engine(**changes: object) -> Engine:
    config = dict(model="synthetic:tiny", device="cpu", dtype="float32",
                  kv_cache_bytes=1 << 22, max_num_batched_tokens=64, chunk_tile=16)
    return Engine(EngineConfig(**(config | changes)))


@pytest.mark.parametrize(("device", "backend"), [("cpu", "torch"), ("cpu", "auto"),
                                                  ("cpu", "flex"), CUDA])
def test_a_step_reads_tensor_values_once(device: str, backend: str) -> None:
    """On a GPU each read is a host sync and the upload is one pinned copy; on the CPU the
    same count holds and nothing needs uploading."""
    _reads_once(device, backend)


def test_flex_block_masks_read_nothing_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's flex path (sparse tiles uploaded with the step, a BlockMask made from them),
    run eagerly on the CPU, where every read of a tensor counts."""
    monkeypatch.setattr(model_runner, "block_masked", lambda device: True)
    _reads_once("cpu", "flex")


def _reads_once(device: str, backend: str) -> None:
    engine = _engine(device=device, attention_backend=backend)
    for i in range(12):
        engine.add_request([3 + (i * 7 + j) % 300 for j in range(5 + 9 * i)], KINDS[i % 3])
    uploads = []
    upload = engine.runner.staging.upload

    def counted(value: object) -> object:
        uploads.append(value)
        return upload(value)

    engine.runner.staging.upload = counted  # type: ignore[method-assign]
    steps = 0
    while engine.has_unfinished():
        uploads.clear()
        before = engine.runner.staging.uploads
        with HostReads(engine.runner.device) as reads:
            engine.step()
        assert reads.total == 1, dict(reads.counts)
        assert len(uploads) == 1
        assert engine.runner.staging.uploads - before == (device == "cuda")
        steps += 1
    assert steps > 8


def test_packed_inputs_come_back_whole() -> None:
    engine = _engine()
    engine.add_request(list(range(3, 40)), KINDS[2])
    engine.add_request(list(range(3, 9)), KINDS[1])
    engine.step()
    engine.add_request(list(range(50, 70)), KINDS[0])
    runner = engine.runner
    batch = engine.scheduler.schedule()
    rows = runner.requests.update(batch)
    from engine.core.sampler import sampling_inputs
    from engine.core.step_inputs import prepare

    inputs = dataclasses.replace(
        prepare(batch.chunks, rows, runner.backend),
        sampling=sampling_inputs([r for c, r in zip(batch.chunks, rows, strict=True)
                                  if c.samples], engine.model_config.vocab_size))
    found = tensors(inputs)
    assert len(found) > 10 and {t.dtype for t in found} >= {torch.int64, torch.float32,
                                                               torch.bool}
    buffer, packed = pack(found, None)
    for original, view in zip(found, unpack(buffer, packed), strict=True):
        assert view.dtype == original.dtype and torch.equal(view, original)
