"""deterministic() context manager: nest-safe, restored on exceptions, per thread."""
import threading

import pytest

import ditron_ops
from ditron_ops.deterministic import resolve_deterministic


def test_nesting_and_restore_on_exception():
    assert not ditron_ops.is_deterministic()
    with ditron_ops.deterministic():
        assert ditron_ops.is_deterministic()
        with ditron_ops.deterministic(False):
            assert not ditron_ops.is_deterministic()
        assert ditron_ops.is_deterministic()
        with pytest.raises(RuntimeError):
            with ditron_ops.deterministic(False):
                raise RuntimeError("inside")
        assert ditron_ops.is_deterministic()
    assert not ditron_ops.is_deterministic()


def test_explicit_flag_wins_and_is_validated():
    with ditron_ops.deterministic():
        assert resolve_deterministic(None) is True
        assert resolve_deterministic(False) is False
    with pytest.raises(TypeError):
        resolve_deterministic("yes")


def test_mode_is_per_thread():
    seen = []
    with ditron_ops.deterministic():
        t = threading.Thread(target=lambda: seen.append(ditron_ops.is_deterministic()))
        t.start()
        t.join()
    assert seen == [False]
