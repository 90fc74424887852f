"""The test-only transfer hold (``SGLANG_PD_FAULT_HOLD_TRANSFER_S``, ``transfer/fault_hook.py``) over the fake
backend: inert unless set, bad values refused, a held READ/WRITE stays PENDING for the hold and then moves exactly the
bytes the real backend moves, a peer that dies during the hold fails the transfer (never DONE), cancel and close fail
held transfers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sglang.srt.disaggregation.transfer import MemRegion, TransferConfig, TransferState, make_transfer_backend
from sglang.srt.disaggregation.transfer.fault_hook import (FAULT_HOLD_ENV, HeldTransferBackend, fault_hold_seconds,
                                                           maybe_hold_transfers)

HOLD = 0.4


@pytest.fixture
def pair():
    cfg = TransferConfig(transfer_timeout_s=5.0, connect_timeout_s=2.0)
    src, dst = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    pre = make_transfer_backend("fake", "prefill", cfg)
    dec = maybe_hold_transfers(make_transfer_backend("fake", "decode", cfg), {FAULT_HOLD_ENV: str(HOLD)})
    pre.register([MemRegion(src.ctypes.data, src.nbytes, "cpu")])
    dec.register([MemRegion(dst.ctypes.data, dst.nbytes, "cpu")])
    dec.connect("prefill", pre.local_metadata())
    pre.connect("decode", dec.local_metadata())
    yield pre, dec, src, dst
    dec.close()
    pre.close()


def _ops(src, dst, n=1024):
    return np.array([[src.ctypes.data, dst.ctypes.data, n]], dtype=np.int64)


def test_inert_unless_set_and_bad_values_refused():
    inner = make_transfer_backend("fake", "x", TransferConfig())
    try:
        for env in ({}, {FAULT_HOLD_ENV: ""}, {FAULT_HOLD_ENV: "0"}):
            assert maybe_hold_transfers(inner, env) is inner
        assert fault_hold_seconds({FAULT_HOLD_ENV: " 2.5 "}) == 2.5
        for bad in ("soon", "-1", "nan"):
            with pytest.raises(ValueError, match=FAULT_HOLD_ENV):
                fault_hold_seconds({FAULT_HOLD_ENV: bad})
        with pytest.raises(ValueError, match="hold_s"):
            HeldTransferBackend(inner, 0.0)
    finally:
        inner.close()


def test_held_read_stays_pending_then_moves_the_bytes(pair):
    pre, dec, src, dst = pair
    assert isinstance(dec, HeldTransferBackend) and dec.port == dec.inner.port  # extras pass through
    h = dec.read("prefill", _ops(src, dst))
    snap = dec.snapshot()
    assert snap["held_now"] == 1 and 0 < snap["held_min_left_s"] <= HOLD and snap["held_total"] == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < HOLD * 0.75:
        assert dec.poll(h) is TransferState.PENDING
        time.sleep(0.02)
    assert not dst.any()  # nothing moved during the hold
    assert dec.wait(h, timeout_s=5.0) is TransferState.DONE
    assert h.elapsed_s >= HOLD
    assert np.array_equal(dst[:1024], src[:1024]) and not dst[1024:].any()
    assert dec.snapshot()["held_now"] == 0 and dec.snapshot()["released"] == 1
    with pytest.raises(Exception, match="unknown peer"):
        dec.read("nobody", _ops(src, dst))
    with pytest.raises(ValueError, match="registered"):
        dec.read("prefill", np.array([[src.ctypes.data, 8, 16]], dtype=np.int64))


def test_peer_dead_during_the_hold_fails_the_transfer(pair):
    pre, dec, src, dst = pair
    h = dec.read("prefill", _ops(src, dst))
    pre.close()  # the peer dies while the READ is held (posted, not yet at the transport)
    assert dec.wait(h, timeout_s=6.0) is TransferState.FAILED
    assert h.elapsed_s >= HOLD and h.error
    assert not dst.any()


def test_cancel_and_close_fail_held_transfers(pair):
    pre, dec, src, dst = pair
    h1, h2 = dec.read("prefill", _ops(src, dst)), dec.write("prefill", _ops(src, dst))
    dec.cancel(h1, "test")
    assert h1.state is TransferState.FAILED and "test" in h1.error
    dec.close()
    assert h2.state is TransferState.FAILED
    time.sleep(HOLD + 0.1)
    assert dec.poll(h1) is TransferState.FAILED and not dst.any()
