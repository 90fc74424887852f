"""Push mode's layerwise KV writes without servers: the executors call a KVLayerListener after each layer's attention
(and only when one is registered and wants the batch), the listener posts layer ``l``'s WRITEs before layer ``l + 1``
runs, the posted rows are exactly the after-the-fact plan's (same bytes, same rows), the data they carry is final,
the CUDA-style posting thread waits on each layer's event without blocking the forward, and failures mark the job
failed (the connector then fails the room closed)."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang.srt.disaggregation.layerwise import LayerwisePush, LayerwisePushListener
from sglang.srt.disaggregation.slot_plan import copies_by_layer, plan_slot_copies
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.executors import KVLayerListener, SequentialExecutor, create_executor
from sglang.srt.model_executor.executors.split import SubBatchExecutor

LAYERS, HEADS, HD = 4, 2, 8
STAGES = ("input_norm", "attention", "post_attention_norm", "mlp")


class FakeLayer:
    """A staged layer whose attention stores fresh random K/V of the batch's slots into layer ``i`` of ``pool``."""

    def __init__(self, i: int, model: "FakeModel"):
        self.i, self.m = i, model

    def stage_names(self):
        return STAGES

    def run_stage(self, stage, st):
        self.m.log.append(("stage", self.i, stage))
        if stage == "input_norm" and st.residual is None:
            st.residual = st.hidden
        if stage == "attention":
            if self.m.fail_at == self.i:
                raise RuntimeError("attention failed")
            slots = st.forward_batch.slots
            self.m.pool.kv_layer_view[self.i, :, slots] = torch.randn(2, len(slots), HEADS, HD, generator=self.m.gen)
        st.hidden = st.hidden * 2 + self.i


class FakeModel:
    """The staged-model contract over ``FakeLayer``s; ``__call__`` is the plain forward (logged as such)."""

    def __init__(self, pool, log):
        self.pool, self.log, self.fail_at = pool, log, None
        self.gen = torch.Generator().manual_seed(0)
        self.decoder_layers = [FakeLayer(i, self) for i in range(LAYERS)]

    def embed(self, ids):
        return ids.float()[:, None]

    def final_norm(self, hidden, residual):
        return hidden + residual

    def compute_logits(self, hidden, fb):
        return hidden

    def __call__(self, ids, positions, fb):
        self.log.append(("plain",))
        from sglang.srt.layers.stages import LayerState

        st = LayerState(self.embed(ids), None, positions, fb)
        for layer in self.decoder_layers:
            for stage in layer.stage_names():
                layer.run_stage(stage, st)
        return self.final_norm(st.hidden, st.residual)


def _batch(slots, rows=(3,)):
    ids = torch.arange(len(slots))
    return SimpleNamespace(input_ids=ids, positions=ids.clone(), slots=list(slots), req_pool_indices_cpu=list(rows),
                           attn_backend=SimpleNamespace(init_forward_metadata=lambda fb: None))


class RecordingBackend:
    """``write`` copies at once (ctypes memmove, rows = remote dst, local src, nbytes) and records which layer the
    rows belong to and how many attention stages had run when it was posted."""

    def __init__(self, src_desc, log, fail_at_layer=None):
        self.desc, self.log, self.fail_at_layer = src_desc, log, fail_at_layer
        self.posts: list[tuple[int, int, np.ndarray]] = []

    def write(self, name, rows):
        layers = {i for i, part in enumerate(copies_by_layer(rows[:, [1, 0, 2]], self.desc)) if len(part)}
        assert len(layers) == 1, "one WRITE carries one layer"
        layer = layers.pop()
        if layer == self.fail_at_layer:
            raise RuntimeError("peer unreachable")
        attentions = sum(1 for e in self.log if e[1:] and e[2] == "attention")
        self.posts.append((layer, attentions, rows.copy()))
        for dst, src, n in rows.tolist():
            ctypes.memmove(dst, src, n)
        return SimpleNamespace(rows=rows)


def _setup(n=7, fail_at_layer=None, src_layout="layer_major", dst_layout="layer_major"):
    src = MHATokenToKVPool(64, 1, torch.float32, HEADS, HD, LAYERS, "cpu", src_layout)
    dst = MHATokenToKVPool(64, 4, torch.float32, HEADS, HD, LAYERS, "cpu", dst_layout)
    g = torch.Generator().manual_seed(1)
    src.kv_data.copy_(torch.randn(src.kv_data.shape, generator=g))  # stale values: a too-early WRITE copies these
    src_slots = (torch.randperm(50, generator=g)[:n] + 1).tolist()
    dst_slots = list(range(8, 8 + n))
    copies = plan_slot_copies(src.describe(), (0, HEADS), src_slots, dst.describe(), (0, HEADS), dst_slots)
    per_layer = [c[:, [1, 0, 2]] for c in copies_by_layer(copies, src.describe(), side=0)]
    log: list = []
    backend = RecordingBackend(src.describe(), log, fail_at_layer)
    job = LayerwisePush(room=5, peers=[("decode-0", per_layer)], num_layers=LAYERS)
    return SimpleNamespace(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots, copies=copies, log=log,
                           backend=backend, job=job, model=FakeModel(src, log))


@pytest.mark.parametrize("src_layout,dst_layout,post_layers", [
    ("token_major", "layer_major", list(range(LAYERS))),  # per (layer, K/V, token) rows: still one WRITE per layer
    ("layer_major", "token_major", list(range(LAYERS))),
    ("token_major", "token_major", [LAYERS - 1])])  # rows cover every layer: posted once the last layer is stored
def test_layerwise_push_with_token_major_pools(src_layout, dst_layout, post_layers):
    """A forced token-major pool on either side of a layerwise push stays correct: every WRITE is posted
    only after the last layer its rows touch was stored, and the decode side ends with the final KV."""
    s = _setup(src_layout=src_layout, dst_layout=dst_layout)
    listener = LayerwisePushListener(s.backend)
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [s.job])
    ex.run(s.model, _batch(s.src_slots))
    assert [(layer, att) for layer, att, _ in s.backend.posts] == [(i, i + 1) for i in post_layers]
    assert s.job.done and not s.job.error and s.job.nbytes == LAYERS * 2 * len(s.src_slots) * HEADS * HD * 4
    torch.testing.assert_close(s.dst.kv_layer_view[:, :, s.dst_slots], s.src.kv_layer_view[:, :, s.src_slots],
                               rtol=0, atol=0)


def test_writes_of_layer_l_are_posted_before_layer_l_plus_1_runs():
    s = _setup()
    listener = LayerwisePushListener(s.backend)
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [s.job])
    out = ex.run(s.model, _batch(s.src_slots))
    assert ("plain",) not in s.log
    # each layer's WRITE was posted right after its own attention and before the next layer's attention
    assert [(layer, att) for layer, att, _ in s.backend.posts] == [(i, i + 1) for i in range(LAYERS)]
    assert s.job.done and not s.job.error and s.job.layers_posted == LAYERS and s.job.started
    # the rows are the after-the-fact plan's rows (same bytes, same number of WRITE rows) ...
    posted = np.concatenate([rows for _, _, rows in s.backend.posts])
    assert sorted(map(tuple, posted.tolist())) == sorted(map(tuple, s.copies[:, [1, 0, 2]].tolist()))
    assert s.job.nbytes == int(s.copies[:, 2].sum()) and s.job.num_ops == len(s.copies)
    # ... and carried the final KV (a WRITE posted before its layer's attention would have copied stale values)
    torch.testing.assert_close(s.dst.kv_data[:, :, s.dst_slots], s.src.kv_data[:, :, s.src_slots], rtol=0, atol=0)
    # the staged forward equals the plain one
    s2 = _setup()
    assert torch.equal(out, SequentialExecutor().run(s2.model, _batch(s2.src_slots)))


def test_no_listener_or_not_wanted_changes_nothing():
    s = _setup()
    ex = SequentialExecutor()
    ex.run(s.model, _batch(s.src_slots))
    assert s.log[0] == ("plain",) and not s.backend.posts  # no listener: the model's own forward
    listener = LayerwisePushListener(s.backend)
    ex.set_kv_layer_listener(listener)
    listener.arm([9], [s.job])  # armed for another batch (request rows differ)
    s.log.clear()
    ex.run(s.model, _batch(s.src_slots, rows=(3,)))
    assert s.log[0] == ("plain",) and not s.backend.posts and not s.job.started
    listener.disarm()
    assert not listener.wants(_batch(s.src_slots, rows=(9,)))


def test_sub_batch_executor_reports_each_layer_once_after_every_sub_batch():
    class TwoHalves(SubBatchExecutor):
        def plan(self, fb):
            half = len(fb.slots) // 2
            return [_batch(fb.slots[:half]), _batch(fb.slots[half:])]

    s = _setup(n=6)
    seen = []

    class Recorder(KVLayerListener):
        def on_layer_kv_written(self, layer_id, fb):
            seen.append((layer_id, sum(1 for e in s.log if e[0] == "stage" and e[2] == "attention")))

        def on_forward_done(self, fb):
            seen.append(("done",))

    ex = TwoHalves()
    ex.set_kv_layer_listener(Recorder())
    ex.run(s.model, _batch(s.src_slots))
    assert seen == [(i, 2 * (i + 1)) for i in range(LAYERS)] + [("done",)]  # both halves' attention, then the call


def test_executor_without_listener_support_refuses_one():
    class Plain(SequentialExecutor):
        name = "plain"
        supports_kv_layer_listener = False

    with pytest.raises(ValueError, match="does not support KV layer listeners"):
        Plain().set_kv_layer_listener(LayerwisePushListener(None))
    create_executor("token_split").set_kv_layer_listener(None)  # removing is always fine


def test_posting_thread_waits_on_each_layer_event_without_blocking_the_forward():
    """The CUDA path on CPU: every layer's call records an 'event' that completes only when released; the forward
    returns at once with nothing posted; released in order, the thread posts layer by layer and closes the job."""
    s = _setup()
    events = []

    class FakeEvent:
        def __init__(self):
            self.ready = threading.Event()

        def synchronize(self):
            assert self.ready.wait(10)

    def make(device):
        events.append(FakeEvent())
        return events[-1]

    listener = LayerwisePushListener(s.backend, event_factory=make)
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [s.job])
    ex.run(s.model, _batch(s.src_slots))
    assert len(events) == LAYERS and not s.backend.posts and not s.job.done
    for i, ev in enumerate(events):
        ev.ready.set()
        deadline = threading.Event()
        for _ in range(200):
            if len(s.backend.posts) > i:
                break
            deadline.wait(0.01)
        assert [p[0] for p in s.backend.posts] == list(range(i + 1))
    for _ in range(200):
        if s.job.done:
            break
        threading.Event().wait(0.01)
    assert s.job.done and not s.job.error
    torch.testing.assert_close(s.dst.kv_data[:, :, s.dst_slots], s.src.kv_data[:, :, s.src_slots], rtol=0, atol=0)
    listener.close()


def test_failures_mark_the_job_failed():
    s = _setup(fail_at_layer=1)  # the WRITE of layer 1 cannot be posted
    listener = LayerwisePushListener(s.backend)
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [s.job])
    ex.run(s.model, _batch(s.src_slots))
    assert s.job.done and "layer 1" in s.job.error and [p[0] for p in s.backend.posts] == [0]  # nothing after it
    s = _setup()
    s.model.fail_at = 2  # the forward stops in layer 2's attention
    listener = LayerwisePushListener(s.backend)
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [s.job])
    with pytest.raises(RuntimeError, match="attention failed"):
        ex.run(s.model, _batch(s.src_slots))
    assert s.job.done and "2 of 4 layers" in s.job.error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_order_the_writes_behind_each_layers_kv_store():
    """On a GPU: each layer's attention is slow (a chain of GEMMs before its KV store) so the host runs far ahead.
    The posting thread's WRITE of layer l snapshots layer l on a side stream (which does not wait for the compute
    stream): the snapshot equals the final KV only if the thread waited on layer l's event. The forward returns
    before the last layer is posted (the host never blocks per layer)."""
    dev = torch.device("cuda")
    pool = MHATokenToKVPool(64, 1, torch.float32, HEADS, HD, LAYERS, "cuda")
    pool.kv_data.fill_(-1.0)  # stale values
    slots = list(range(5, 17))
    snaps: dict[int, torch.Tensor] = {}
    side = torch.cuda.Stream(dev)
    posted_at: list[float] = []

    class SnapBackend:
        def write(self, name, rows):
            layer = int((rows[0, 1] - pool.describe().base_address) // pool.describe().stride_bytes("layer"))
            with torch.cuda.stream(side):
                snaps[layer] = pool.kv_data[layer][:, slots].to("cpu")
            posted_at.append(time.monotonic())
            return SimpleNamespace()

    class SlowLayer(FakeLayer):
        def run_stage(self, stage, st):
            if stage == "attention":
                x = torch.randn(2048, 2048, device=dev)
                for _ in range(40):
                    x = torch.tanh(x @ x)
                pool.kv_data[self.i, :, slots] = x[: 2 * len(slots) * HEADS * HD // 2048 + 1].flatten()[
                    : 2 * len(slots) * HEADS * HD].view(2, len(slots), HEADS, HD) + self.i
                st.hidden = st.hidden * 2 + self.i
                return
            super().run_stage(stage, st)

    model = FakeModel(pool, [])
    model.decoder_layers = [SlowLayer(i, model) for i in range(LAYERS)]
    src = pool.describe()
    copies = plan_slot_copies(src, (0, HEADS), slots, src, (0, HEADS), list(range(30, 30 + len(slots))))
    job = LayerwisePush(room=1, peers=[("d", [c[:, [1, 0, 2]] for c in copies_by_layer(copies, src)])],
                        num_layers=LAYERS)
    listener = LayerwisePushListener(SnapBackend())
    ex = SequentialExecutor()
    ex.set_kv_layer_listener(listener)
    listener.arm([3], [job])
    ids = torch.arange(len(slots), device=dev)
    fb = SimpleNamespace(input_ids=ids, positions=ids.clone(), slots=slots, req_pool_indices_cpu=[3],
                         attn_backend=SimpleNamespace(init_forward_metadata=lambda fb: None))
    ex.run(model, fb)
    returned = time.monotonic()
    for _ in range(1000):
        if job.done:
            break
        time.sleep(0.01)
    torch.cuda.synchronize()
    assert job.done and not job.error and sorted(snaps) == list(range(LAYERS))
    for layer in range(LAYERS):
        torch.testing.assert_close(snaps[layer], pool.kv_data[layer][:, slots].cpu(), rtol=0, atol=0)
    assert posted_at[-1] > returned
    listener.close()


def test_push_wait_timeout_flag_validated():
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs().disaggregation_push_wait_timeout == 0.5
    assert ServerArgs(disaggregation_push_wait_timeout=0).disaggregation_push_wait_timeout == 0
    with pytest.raises(ValueError, match="disaggregation-push-wait-timeout"):
        ServerArgs(disaggregation_push_wait_timeout=-1)
