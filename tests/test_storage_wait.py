"""StorageWait's schedule on a scripted clock, and the settings that shape it (the real outage runs in
tests/service/test_storage_outage.py)."""

from __future__ import annotations

import pytest

from auk_worker.errors import Canceled, ConfigError, InfraError, InputError, StorageUnavailable
from auk_worker.service.connect.settings import Settings
from auk_worker.service.connect.storage import StorageWait


class Clock:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def refusing(times: int, then: object = "ok"):
    calls = {"n": 0}

    def fn() -> object:
        calls["n"] += 1
        if calls["n"] <= times:
            raise InfraError("storage put failed: connection refused")
        return then

    return fn, calls


def test_backoff_doubles_with_jitter_up_to_its_cap_and_a_success_returns() -> None:
    clock = Clock()
    wait = StorageWait(600.0, 1.0, 8.0, clock=lambda: clock.now, sleep=clock.sleep)
    fn, calls = refusing(7)
    assert wait.call("upload a", fn) == "ok" and calls["n"] == 8
    for step, slept in zip([1, 2, 4, 8, 8, 8, 8], clock.sleeps):
        assert step / 2 <= slept <= step


def test_the_deadline_is_time_since_the_first_refusal_not_a_count_of_tries() -> None:
    for backoff, cap in ((0.01, 0.05), (1.0, 30.0)):
        clock = Clock()
        wait = StorageWait(100.0, backoff, cap, clock=lambda: clock.now, sleep=clock.sleep)
        fn, calls = refusing(10**9)
        with pytest.raises(StorageUnavailable, match=r"unreachable for 100\.0 s .* past AUK_STORAGE_RETRY_DEADLINE"):
            wait.call("upload a", fn)
        assert clock.now == pytest.approx(100.0)  # the last sleep ends on the deadline, never past it
        assert calls["n"] > 7  # however many tries that takes (about 2,700 and about 9 here)


def test_a_success_ends_the_outage_and_other_errors_pass_through() -> None:
    clock = Clock()
    wait = StorageWait(10.0, 1.0, 4.0, clock=lambda: clock.now, sleep=clock.sleep)
    fn, _ = refusing(3)
    wait.call("fetch a", fn)  # about 3.5 s down, then a success
    fn, _ = refusing(4)
    assert wait.call("upload a", fn) == "ok"  # a fresh outage gets the whole deadline again
    missing = InputError("no object 'a'", code="audio_not_found")

    def fails() -> None:
        raise missing

    with pytest.raises(InputError):
        wait.call("fetch b", fails)


def test_between_tries_a_cancel_stops_the_wait() -> None:
    clock = Clock()
    wait = StorageWait(600.0, 1.0, 8.0, clock=lambda: clock.now, sleep=clock.sleep)
    fn, calls = refusing(10**9)

    def canceled_after_three() -> None:
        if calls["n"] >= 3:
            raise Canceled("job a was canceled while waiting for storage")

    with pytest.raises(Canceled):
        wait.call("upload a", fn, canceled_after_three)
    assert calls["n"] == 3


def test_storage_retry_settings_defaults_and_validation() -> None:
    settings = Settings.from_env({})
    assert (settings.storage_retry_deadline_s, settings.storage_retry_backoff_s,
            settings.storage_retry_backoff_max_s) == (1800.0, 1.0, 30.0)  # fmt: skip
    custom = Settings.from_env({"AUK_STORAGE_RETRY_DEADLINE": "600", "AUK_STORAGE_RETRY_BACKOFF": "0.5",
                                "AUK_STORAGE_RETRY_BACKOFF_MAX": "5"})  # fmt: skip
    assert (custom.storage_retry_deadline_s, custom.storage_retry_backoff_s,
            custom.storage_retry_backoff_max_s) == (600.0, 0.5, 5.0)  # fmt: skip
    for env, message in (
        ({"AUK_STORAGE_RETRY_DEADLINE": "0"}, "AUK_STORAGE_RETRY_DEADLINE must be a positive number"),
        ({"AUK_STORAGE_RETRY_DEADLINE": "soon"}, "AUK_STORAGE_RETRY_DEADLINE must be a number of seconds"),
        ({"AUK_STORAGE_RETRY_BACKOFF": "inf"}, "AUK_STORAGE_RETRY_BACKOFF must be a positive number"),
        ({"AUK_STORAGE_RETRY_BACKOFF": "10", "AUK_STORAGE_RETRY_BACKOFF_MAX": "5"}, "must not exceed"),
        ({"AUK_RETRY_BACKOFF": "-1"}, "AUK_RETRY_BACKOFF must be a positive number"),
    ):
        with pytest.raises(ConfigError, match=message):
            Settings.from_env(env)
