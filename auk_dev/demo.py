"""``python -m auk_dev.demo`` (``make run``): the whole service on this machine, then a demo batch through it.

It starts, under ``./run/`` (``--workdir``): a private ``redis-server`` (append-only file under ``./run/redis``,
fsynced every second as docker-compose.yml runs it; port ``--redis-port``, else a free one), a SeaweedFS S3 server
(``weed``; S3 port ``--s3-port``, else a free one), one worker process and the API on
127.0.0.1:${AUK_API_PORT:-8000}. What an earlier run on the same directory left running when it was stopped hard
(its supervisor killed) is found and stopped first: its children carry the run's directory in their environment,
and a ``redis-server`` or ``weed`` working in ``./run/redis`` or ``./run/s3`` is found by its working directory
(two servers on one append-only file corrupt it). The worker serves
the checkpoint in ``AUK_CHECKPOINT`` when it is set (real weights; the variant is the checkpoint's own), otherwise a
tiny checkpoint with random weights written to ``./run/tiny-checkpoint`` (its audio is noise).

Every ``AUK_*`` setting in the environment is used as given; only what is missing is made up: ``AUK_API_KEYS``
(the first key is the demo's own), the S3 credentials, bucket and prefix. ``AUK_REDIS_URL`` or ``AUK_S3_ENDPOINT``
set means that Redis or that store is used and none is started. What was taken and what was made up is printed.

Once a worker is ready it submits a small batch of instruct-TTS jobs over the REST API, follows it, downloads the
WAVs to ``./run/out/`` and prints where they are, locally and in the bucket. Then the service keeps running for
your own requests until Ctrl-C or SIGTERM (``--once`` stops it after the batch): a child that exits (the worker,
the API, Redis, storage) is started again, and the restarts are printed and kept in ``./run/status.json``. Every
child process is stopped on the way out, in order, each named with how it is stopped: the API, the worker
(SIGTERM: its running job finishes within ``AUK_STOP_GRACE``, else goes back to the queue; SIGKILL only past that
and the release time), storage, Redis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import httpx

from auk_worker.errors import AuKError
from auk_dev.local import (
    GRPC_OFFSET,
    REPO,
    ApiProcess,
    RedisServer,
    S3Server,
    WorkerProcess,
    marked,
    port_free,
    stop_pid,
    strays,
)
from auk_worker.service.worker.stopping import RELEASE_S
from auk_dev.supervisor import Supervisor

SAMPLE_RATE = 24_000
HOP = 480  # samples per latent frame at 24 kHz
BUCKET = "auk"
PREFIX = "demo"
TINY_STEPS = 4  # the tiny checkpoint renders noise, so a few steps show the path without waiting for 32
# In every child's environment, the run's directory: found again after a hard stop (not AUK_*: no setting).
RUN_MARK = "AUKDEV_RUN_DIR"  # redis-server overwrites its environment: found by its directory instead

DEMO_LINES = [
    ("demo-1", 1.0, "A calm, low female voice, close to the microphone.", "Good morning, and welcome."),
    ("demo-2", 1.5, "An energetic young man, speaking quickly.", "The results are in, and they look great."),
    ("demo-3", 2.0, "An elderly storyteller with a warm, slow voice.", "Once upon a time, by the sea."),
    ("demo-4", 1.2, "A clear, natural voice.", "Thank you for listening."),
]


class Stop(Exception):
    """Raised from the signal handler: SIGINT or SIGTERM asked the demo to stop."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def instruct_tts(description: str, text: str) -> str:
    """The upstream instruct-TTS template (the description first, then the words to speak)."""
    return f'Generate speech based on the following description: "{description}". The content to speak is: "{text}".'


def expected_samples(gen_seconds: float) -> int:
    return math.ceil(50 * gen_seconds) * HOP


def say(text: str = "") -> None:
    print(text, flush=True)


def _user_settings() -> dict[str, str]:
    """The ``AUK_*`` variables the user set (non-empty)."""
    return {k: v.strip() for k, v in os.environ.items() if k.startswith("AUK_") and v.strip()}


def _checkpoint(workdir: Path) -> tuple[Path | None, str, bool]:
    """(checkpoint directory, variant, is_tiny): ``AUK_CHECKPOINT`` if set, else a fresh tiny base checkpoint; no
    checkpoint for ``AUK_PIPELINE=instant`` (the model-free pipeline: its audio is silence)."""
    if os.environ.get("AUK_PIPELINE", "").strip() == "instant":
        return None, os.environ.get("AUK_VARIANT", "").strip() or "base", False
    configured = os.environ.get("AUK_CHECKPOINT", "").strip()
    if configured:
        from auk_worker.checkpoint import read_release

        release = read_release(configured)
        return Path(configured).resolve(), release.variant, False
    from auk_worker.tiny.checkpoint import make_tiny_checkpoint

    out = make_tiny_checkpoint(workdir / "tiny-checkpoint", variant="base")
    return Path(out).resolve(), "base", True


def _batch_jsonl(variant: str, is_tiny: bool) -> str:
    lines = []
    for custom_id, seconds, description, text in DEMO_LINES:
        job = {"custom_id": custom_id, "instruction": instruct_tts(description, text), "gen_seconds": seconds,
               "variant": variant}  # the queues of the one worker's variant
        if is_tiny:
            job["num_inference_steps"] = TINY_STEPS
        lines.append(json.dumps(job))
    return "\n".join(lines) + "\n"


def _wait_ready(http: httpx.Client, worker: WorkerProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if worker.proc is not None and worker.proc.poll() is not None:
            raise RuntimeError(f"the worker exited with status {worker.proc.returncode}:\n{worker.log_tail()}")
        try:
            body = http.get("/readyz").json()
            if body.get("workers_ready", 0) >= 1:
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker became ready within {timeout:.0f} s:\n{worker.log_tail()}")
        time.sleep(0.5)


def _follow_batch(http: httpx.Client, batch_id: str, total: int, timeout: float) -> dict:
    """Poll the batch until it is done: a progress bar on a terminal, a line per change otherwise."""
    from tqdm import tqdm

    deadline = time.monotonic() + timeout
    bar = tqdm(total=total, unit="job", desc="demo batch", file=sys.stdout, disable=not sys.stdout.isatty())
    last = ""
    try:
        while True:
            batch = http.get(f"/v1/batches/{batch_id}").raise_for_status().json()
            counts = batch["counts"]
            label = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            bar.n = sum(counts.get(s, 0) for s in ("succeeded", "failed", "canceled"))
            bar.set_postfix_str(label, refresh=False)
            bar.refresh()
            if bar.disable and label != last:
                say(f"  batch: {label}")
                last = label
            if batch["status"] == "done":
                return batch
            if time.monotonic() > deadline:
                raise RuntimeError(f"the demo batch did not finish within {timeout:.0f} s: {label}")
            time.sleep(0.5)
    finally:
        bar.close()


def _download(url: str, dest: Path) -> None:
    response = httpx.get(url, timeout=60)  # presigned: the URL carries its own signature
    response.raise_for_status()
    dest.write_bytes(response.content)


def _service_env(user: dict[str, str], redis_server: RedisServer | None, s3: S3Server | None,
                 made_up: dict[str, str]) -> dict[str, str]:
    """The children's ``AUK_*`` environment: the user's settings over what this run made up (``made_up`` plus the
    connection settings of the servers it started)."""
    started: dict[str, str] = {}
    if redis_server is not None:
        started["AUK_REDIS_URL"] = redis_server.url
    if s3 is not None:
        started.update(AUK_S3_ENDPOINT=s3.endpoint, AUK_S3_ACCESS_KEY=s3.access_key, AUK_S3_SECRET_KEY=s3.secret_key,
                       AUK_S3_REGION=s3.region)  # fmt: skip
    return {**made_up, **started, **user}


def run_demo(args: argparse.Namespace) -> int:
    workdir = args.workdir.resolve()
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _stop_earlier_run(workdir)  # before the port checks: an earlier run's API may hold the port
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    os.environ[RUN_MARK] = str(workdir)  # every child inherits it
    user = _user_settings()
    raw_port = user.get("AUK_API_PORT", "8000")
    if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
        say(f"error: AUK_API_PORT must be a port number, got {raw_port!r}")
        return 2
    port = int(raw_port)
    if not port_free(port):
        say(f"error: 127.0.0.1:{port} is in use; choose another port with AUK_API_PORT=... (e.g. 8001)")
        return 2
    if "AUK_S3_ENDPOINT" in user and not ("AUK_S3_ACCESS_KEY" in user and "AUK_S3_SECRET_KEY" in user):
        say("error: AUK_S3_ENDPOINT is set: set AUK_S3_ACCESS_KEY and AUK_S3_SECRET_KEY for it too")
        return 2
    for what, chosen, also in (("--redis-port", args.redis_port, None), ("--s3-port", args.s3_port, GRPC_OFFSET)):
        if chosen is None:
            continue
        ports = [chosen] if also is None else [chosen, chosen + also]  # weed's gRPC listens on its port + 10000
        if not all(0 < p < 65536 and port_free(p) for p in ports):
            say(f"error: {what} {chosen}: 127.0.0.1:{' and '.join(map(str, ports))} must be free; choose another")
            return 2

    checkpoint, variant, is_tiny = _checkpoint(workdir)
    quick = is_tiny or checkpoint is None  # a few steps are enough for noise or silence
    deploy_default = REPO / "config" / ("auk-flash.yaml" if variant == "flash" else "auk.yaml")
    deploy = Path(user.get("AUK_DEPLOY_CONFIG") or deploy_default).resolve()
    if checkpoint is None:
        say("pipeline: instant (AUK_PIPELINE=instant: no model, the WAVs are silence)")
    elif is_tiny:
        say(f"checkpoint: {checkpoint} (tiny, random weights: the WAVs are noise; set AUK_CHECKPOINT to a release "
            f"directory from `auk download` for speech)")
    else:
        say(f"checkpoint: {checkpoint} ({variant})")

    keys = [k.strip() for k in user.get("AUK_API_KEYS", "").split(",") if k.strip()]
    api_key = keys[0] if keys else f"auk-demo-{secrets.token_urlsafe(18)}"
    made_up = {"AUK_API_KEYS": api_key, "AUK_S3_BUCKET": BUCKET, "AUK_S3_PREFIX": PREFIX, "AUK_VARIANT": variant,
               "AUK_PIPELINE": "auk", "AUK_DEPLOY_CONFIG": str(deploy)}  # fmt: skip
    if checkpoint is not None:
        made_up["AUK_CHECKPOINT"] = str(checkpoint)
    made_up["AUK_S3_INPUT_BUCKET"] = user.get("AUK_S3_BUCKET", BUCKET)
    made_up["AUK_S3_INPUT_PREFIX"] = "inputs"  # where audio.key may read: apart from what the service writes
    redis_server = None
    if "AUK_REDIS_URL" not in user:  # fsynced every second, as docker-compose.yml runs it
        redis_server = RedisServer(workdir / "redis", port=args.redis_port, persist=True, fsync="everysec")
    s3 = None if "AUK_S3_ENDPOINT" in user else S3Server(
        workdir / "s3", user.get("AUK_S3_ACCESS_KEY"), user.get("AUK_S3_SECRET_KEY"), s3_port=args.s3_port)
    supervisor = Supervisor(workdir / "status.json")
    worker: WorkerProcess | None = None
    api: ApiProcess | None = None
    try:
        if redis_server is not None:
            redis_server.start()
            say(f"started redis-server on 127.0.0.1:{redis_server.port} (pid {redis_server.proc.pid}, append-only "
                f"file under {redis_server.workdir}, log {redis_server.log})")
            supervisor.add("redis", redis_server)
        if s3 is not None:
            s3.start()
            say(f"started SeaweedFS S3 on {s3.endpoint} (pid {s3.proc.pid}, data under {s3.workdir}, log {s3.log})")
            supervisor.add("storage", s3)
        env = _service_env(user, redis_server, s3, made_up)
        env["AUK_API_PORT"] = str(port)
        taken = sorted(k for k in user if k in env)
        invented = sorted(k for k in made_up if k not in user) + (["AUK_S3_ACCESS_KEY", "AUK_S3_SECRET_KEY"] if s3
                  is not None and "AUK_S3_ACCESS_KEY" not in user else [])  # fmt: skip
        say(f"settings from your environment: {', '.join(taken) or 'none'}")
        say(f"settings made up for this run: {', '.join(invented) or 'none'}")
        say(f"starting the worker ({variant}, {deploy.name}) and the API on 127.0.0.1:{port}")
        worker = WorkerProcess(env, "demo-worker", workdir).start()
        supervisor.add("worker", worker)
        api = ApiProcess(env, port, workdir / "api.log").start()
        supervisor.add("api", api)
        _write_env_file(workdir / "demo.env", api.url, api_key, env)

        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
            say("waiting for the worker to load the model ...")
            started = time.monotonic()
            _wait_ready(http, worker, args.ready_timeout)
            say(f"worker ready after {time.monotonic() - started:.1f} s")
            started = time.monotonic()
            results = _submit_and_fetch(http, variant, quick, out_dir, args.batch_timeout)
            say(f"batch rendered and downloaded in {time.monotonic() - started:.1f} s")
        logs = [str(workdir / "*.log")] + [str(server.log) for server in (redis_server, s3) if server is not None]
        _print_summary(results, api.url, api_key, env, workdir, variant, is_tiny, quick, logs)
        if args.once:
            return 0
        say(f"\nthe service keeps running; a child that exits is restarted ({workdir}/status.json); Ctrl-C stops it")
        while True:
            for event in supervisor.check():
                say(f"supervisor: {event}")
                if "restarted" in event:
                    say(f"status: {supervisor.summary()}")
            time.sleep(0.5)
    except Stop as stop:
        say(f"\n{stop}: stopping")
        return 0
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        if supervisor.children:
            say(f"status: {supervisor.summary()}")
        _shutdown(api, worker, s3, redis_server)


def _submit_and_fetch(http: httpx.Client, variant: str, quick: bool, out_dir: Path, timeout: float) -> list[dict]:
    body = _batch_jsonl(variant, quick)
    response = http.post("/v1/batches", content=body, headers={"Content-Type": "application/x-ndjson"})
    if response.is_error:
        raise RuntimeError(f"the API refused the demo batch: HTTP {response.status_code} {response.text[:500]}")
    batch = response.json()
    steps = f"{TINY_STEPS} steps" if quick else f"{variant}, the deploy config's sampling"
    say(f"submitted batch {batch['id']}: {batch['total']} instruct-TTS jobs of 1-2 s, {steps}")
    batch = _follow_batch(http, batch["id"], batch["total"], timeout)

    jobs = http.get("/v1/jobs", params={"batch_id": batch["id"], "limit": 100}).raise_for_status().json()["data"]
    results = []
    for job in sorted(jobs, key=lambda j: j.get("custom_id") or j["id"]):
        entry = {"custom_id": job.get("custom_id"), "id": job["id"], "status": job["status"]}
        if job["status"] == "succeeded":
            result = job["result"]
            dest = out_dir / f"{job.get('custom_id') or job['id']}.wav"
            _download(result["url"], dest)
            entry.update(path=str(dest), bucket=result["bucket"], key=result["key"],
                         duration_s=result.get("duration_s"), gen_seconds=job["request"].get("gen_seconds"))  # fmt: skip
        else:
            entry["error"] = job.get("error")
        results.append(entry)
    manifest = batch.get("manifest")
    if manifest:
        _download(manifest["url"], out_dir / f"batch-{batch['id']}.manifest.jsonl")
        results.append({"manifest": str(out_dir / f"batch-{batch['id']}.manifest.jsonl"), "key": manifest["key"]})
    (out_dir / "demo-results.json").write_text(json.dumps(results, indent=2) + "\n")
    failed = [r for r in results if r.get("status") not in (None, "succeeded")]
    if failed:
        raise RuntimeError(f"{len(failed)} demo jobs did not succeed: {json.dumps(failed)}")
    return results


def _write_env_file(path: Path, url: str, api_key: str, env: dict[str, str]) -> None:
    """Settings of this run for a second shell: ``set -a; . run/demo.env; set +a`` then ``auk submit ...``."""
    lines = [f"AUK_API_URL={url}", f"AUK_API_KEY={api_key}", *(f"{k}={v}" for k, v in env.items())]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


def _print_summary(results: list[dict], url: str, api_key: str, env: dict[str, str], workdir: Path, variant: str,
                   is_tiny: bool, quick: bool, logs: list[str]) -> None:  # fmt: skip
    say("\nrendered:")
    for r in results:
        if "path" in r:
            say(f"  {r['custom_id']}: {r['path']} ({r['duration_s']} s) = s3://{r['bucket']}/{r['key']}")
        elif "manifest" in r:
            say(f"  manifest: {r['manifest']} = s3://{env['AUK_S3_BUCKET']}/{r['key']}")
    if is_tiny:
        say("  (tiny checkpoint with random weights: these WAVs are noise of the right length)")
    say(f"\nAPI        {url}  (docs: {url}/docs)")
    say(f"API key    {api_key}")
    say(f"S3         {env['AUK_S3_ENDPOINT']}  access key {env['AUK_S3_ACCESS_KEY']}  secret key (in demo.env)")
    say(f"logs       {', '.join(logs)}")  # the logs of what this run started, no other
    say(f"settings   {workdir}/demo.env  (in another shell: set -a; . {workdir}/demo.env; set +a)")
    say(f'try        auk submit --instruction \'{instruct_tts("A clear, natural voice.", "Hello there.")}\' '
        f"--gen-seconds 2{' --steps 4' if quick else ''}{' --variant flash' if variant == 'flash' else ''}")
    say(f"           curl -H 'Authorization: Bearer {api_key}' {url}/v1/jobs")


def _stop_earlier_run(workdir: Path) -> None:
    """Stop what an earlier run on ``workdir`` left running when it was stopped hard (its supervisor killed): the
    processes it marked, the API and worker first (a worker's SIGTERM is its graceful stop), then storage and
    Redis; then any redis-server or weed on its directories that a run before these marks left."""
    pids = marked(RUN_MARK, str(workdir))
    servers = {"redis-server", "weed"}
    names = {pid: _comm(pid) for pid in pids}
    for pid in sorted(pids, key=lambda p: names[p] in servers):
        say(f"found {names[pid]} (pid {pid}) of an earlier run on {workdir} that was stopped hard; stopping it "
            f"(SIGTERM, SIGKILL after {_stop_grace() + RELEASE_S + 15:g} s)")  # fmt: skip
        if not stop_pid(pid, timeout=_stop_grace() + RELEASE_S + 15):
            raise RuntimeError(f"{names[pid]} (pid {pid}) of an earlier run did not stop; stop it by hand")
    _stop_strays(workdir / "redis", "redis-server")
    _stop_strays(workdir / "s3", "weed")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "process"


def _stop_strays(workdir: Path, program: str) -> None:
    """Stop a ``program`` an earlier run stopped hard left running on ``workdir`` (never a second one on its data)."""
    for pid in strays(workdir, program):
        say(f"found {program} (pid {pid}) still running on {workdir}, left by an earlier run that was stopped hard; "
            "stopping it (SIGTERM, SIGKILL after 15 s) before starting this run's")  # fmt: skip
        if not stop_pid(pid):
            raise RuntimeError(f"{program} (pid {pid}) on {workdir} did not stop; stop it by hand")


def _running(child) -> int | None:
    proc = getattr(child, "proc", None) if child is not None else None
    return proc.pid if proc is not None and proc.poll() is None else None


def _stopped(name: str, child) -> None:
    code = child.proc.returncode
    # uvicorn shuts down on SIGTERM and then raises the signal again, so a clean stop of the API ends as -15
    how = {-9: "killed (SIGKILL)", -15: "shut down on SIGTERM"}.get(code, f"exit status {code}")
    say(f"  {name} stopped ({how})")


def _shutdown(api: ApiProcess | None, worker: WorkerProcess | None, s3: S3Server | None,
              redis_server: RedisServer | None) -> None:
    """Stop the children in order, each named with how: no new requests, the running job finishes (or goes back to
    the queue), then storage and Redis."""
    grace = _stop_grace()
    worker_wait = grace + RELEASE_S + 15  # the grace, the release of a job past it, the exit
    with _signals_ignored():
        if (pid := _running(api)) is not None:
            say(f"stopping the API (pid {pid}): SIGTERM, SIGKILL after 10 s")
            api.stop()
            _stopped("API", api)
        if (pid := _running(worker)) is not None:
            say(f"stopping the worker (pid {pid}): SIGTERM; a running job finishes within AUK_STOP_GRACE ({grace:g} s),"
                f" else goes back to the queue (not counted as a crash); SIGKILL after {worker_wait:g} s")
            worker.terminate(timeout=worker_wait)
            _stopped("worker", worker)
        if (pid := _running(s3)) is not None:
            say(f"stopping SeaweedFS (pid {pid}): SIGTERM, SIGKILL after 3 s (its data survives either)")
            s3.stop()
            _stopped("SeaweedFS", s3)
        if (pid := _running(redis_server)) is not None:
            say(f"stopping redis-server (pid {pid}): SIGTERM, it syncs its append-only file; SIGKILL after 10 s")
            redis_server.stop()
            _stopped("redis-server", redis_server)


def _stop_grace() -> float:
    try:
        return max(0.0, float(os.environ.get("AUK_STOP_GRACE", "") or 30.0))
    except ValueError:
        return 30.0


class _signals_ignored:
    """A second Ctrl-C during shutdown must not leave children behind."""

    def __enter__(self) -> None:
        self.saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *_: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m auk_dev.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="stop the service after the demo batch")
    parser.add_argument("--workdir", type=Path, default=Path("run"), help="data, logs and WAVs (default ./run)")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds to wait for the worker to load the model (default 900)")  # fmt: skip
    parser.add_argument("--batch-timeout", type=float, default=600.0,
                        help="seconds to wait for the demo batch (default 600)")  # fmt: skip
    parser.add_argument("--redis-port", type=int, help="the redis-server's port (default: a free one)")
    parser.add_argument("--s3-port", type=int,
                        help="SeaweedFS's S3 port (default: a free one; its gRPC takes this port + 10000)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        return run_demo(args)
    except Stop as stop:  # before any child was started
        say(f"{stop}: stopped")
        return 0
    except AuKError as exc:  # a checkpoint or config that cannot be used, before any child was started
        say(f"error: {exc.message}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
