"""Many hosts, one service: three workers run as separate hosts would (their own ``AUK_WORKER_ID``, working
directory, ``HOME`` and ``TMPDIR``) against one redis-server and one SeaweedFS, render a 1,000-job batch sent
through the API, while a random busy worker is SIGKILLed 20 times and started again each time under its id, as a
supervisor would. ``bench/soak.py`` is the same run, longer, by hand.
"""

from __future__ import annotations

from pathlib import Path

from bench.soak import Soak, SoakConfig, print_report

RECOVERY_TARGET_S = 30.0


def test_three_hosts_1000_jobs_20_kills_every_job_once(tmp_path: Path) -> None:
    config = SoakConfig(jobs=1000, workers=3, kills=20, kill_every_s=2.5, restart_delay_s=0.5, step_delay_s=0.1,
                        steps=8, timeout_s=420, stall_s=45)  # fmt: skip
    soak = Soak(config, tmp_path)
    try:
        soak.start()
        report = soak.run()
    finally:
        soak.stop()
    print()
    print_report(report)
    summary = report.summary()
    assert summary["kills"] == config.kills and summary["jobs_hit"] >= config.kills, summary
    assert report.succeeded == config.jobs, report.errors
    assert report.lost == report.stuck == report.failed == report.duplicated == 0, (summary, report.stuck_ids)
    assert report.wavs == config.jobs, summary  # one object per job once the killed attempts' orphans are swept
    assert report.wavs == config.jobs  # exactly one WAV per job
    assert report.manifest_lines == config.jobs and report.manifest_complete
    assert summary["recovery_max_s"] < RECOVERY_TARGET_S, [k for k in report.kills]
