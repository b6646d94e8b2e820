"""The batch listening page in a real headless browser: Debian's ``chromium`` driven by Playwright against the real
API, an instant-pipeline worker, the session's Redis and SeaweedFS.

The page is opened from the link ``auk page`` prints; every player's source is fetched from the page's own context
and decoded (Web Audio), and must hold the samples its row states; the players themselves load the stated duration;
the failed line can be brought first with the keyboard alone; foreign, tampered and expired links are refused. A
screenshot is kept under ``tests/artifacts/`` (ignored by git) and its path printed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf

from api.batch_page_links import LinkSigner
from auk_worker.cli import main as auk
from auk_worker.service.connect.settings import Settings
from tests.service.batch_service import KEY_A, KEY_B, KEY_C, BatchService, batch_service
from tests.service.conftest import BUCKET
from tests.service.harness import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
LINES = [("intro", 0.3, "pcm16"), ("chapter-1", 0.55, "float32"), ("broken", None, "pcm16"),
         ("chapter-2", 0.8, "pcm16"), ("outro", 1.1, "pcm16")]  # fmt: skip
SR = 24_000


def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing; the test skips, saying why, only if that fails."""
    path = shutil.which("chromium")
    if path is None and shutil.which("apt-get") and os.geteuid() == 0:
        for command in (["apt-get", "install", "-y", "-qq", "chromium"], ["apt-get", "update", "-qq"],
                        ["apt-get", "install", "-y", "-qq", "chromium"]):  # fmt: skip
            subprocess.run(command, capture_output=True, timeout=900, check=False)
            path = shutil.which("chromium")
            if path:
                break
    if path is None:
        pytest.skip("chromium is not installed and `apt-get install -y chromium` could not install it")
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    executable = chromium()
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def svc(redis_server, s3_server, tmp_path_factory) -> Iterator[BatchService]:
    with batch_service(redis_server, s3_server, tmp_path_factory.mktemp("page"), "test-page") as service:
        yield service


@pytest.fixture(scope="module")
def batch_id(svc: BatchService) -> str:
    """A done batch of five lines: four rendered (two formats), one failed at the worker (its clip deleted)."""
    buf = io.BytesIO()
    sf.write(buf, np.zeros(8000, np.float32) + 0.05, 16_000, format="WAV")
    with svc.client() as http:
        upload = http.post("/v1/uploads", files={"file": ("ref.wav", buf.getvalue(), "audio/wav")}).json()
        lines = []
        for custom_id, seconds, fmt in LINES:
            line = {"instruction": f"Read {custom_id}.", "custom_id": custom_id, "output_format": fmt}
            line.update({"gen_seconds": seconds} if seconds else {"audio": {"upload_id": upload["upload_id"]}})
            lines.append(json.dumps(line))
        created = http.post("/v1/batches", content="\n".join(lines), headers={"Content-Type": "text/plain"})
        assert created.status_code == 202, created.text
    svc.s3.client().delete_object(Bucket=BUCKET, Key=f"{svc.prefix}/uploads/{upload['upload_id']}")
    svc.start_worker("page-base")
    state = svc.wait_batch(created.json()["id"])
    assert state["counts"]["succeeded"] == 4 and state["counts"]["failed"] == 1, state
    return state["id"]


def page_url(svc: BatchService, batch_id: str, capsys) -> str:
    """The link as a user gets it: printed by ``auk page``."""
    os.environ["AUK_API_URL"], os.environ["AUK_API_KEY"] = svc.url, KEY_A
    try:
        capsys.readouterr()
        assert auk(["page", batch_id]) == 0
    finally:
        del os.environ["AUK_API_URL"], os.environ["AUK_API_KEY"]
    url = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{re.escape(svc.url)}/batches/{batch_id}\?exp=\d+&sig=[\w-]+", url), url
    return url


DECODE_EVERY_SOURCE = """
async () => {
  const out = [];
  for (const audio of document.querySelectorAll('audio')) {
    const response = await fetch(audio.src);
    const bytes = await response.arrayBuffer();
    const rate = Number(audio.dataset.sampleRate);
    const decoded = await new OfflineAudioContext(1, 1, rate).decodeAudioData(bytes);
    out.push({label: audio.getAttribute('aria-label'), status: response.status,
              type: response.headers.get('content-type'), samples: decoded.length, rate: decoded.sampleRate,
              stated: Number(audio.dataset.samples), statedSeconds: Number(audio.dataset.duration)});
  }
  return out;
}
"""

LOAD_EVERY_PLAYER = """
async () => Promise.all(Array.from(document.querySelectorAll('audio')).map((audio) => new Promise((done) => {
  audio.addEventListener('loadedmetadata', () => done({duration: audio.duration,
                                                       stated: Number(audio.dataset.duration)}), {once: true});
  audio.addEventListener('error', () => done({error: audio.error && audio.error.code}), {once: true});
  audio.preload = 'metadata';
  audio.load();
})))
"""


def test_the_page_lists_every_line_and_every_player_plays_its_stated_length(svc, batch_id, browser, capsys) -> None:
    url = page_url(svc, batch_id, capsys)
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    try:
        response = page.goto(url)
        assert response.status == 200 and response.headers["content-type"].startswith("text/html")
        assert page.title() == f"Batch {batch_id}"
        rows = page.locator("#lines tbody tr")
        assert rows.count() == len(LINES)
        table = [[cell.inner_text().strip() for cell in rows.nth(i).locator("td, th").all()]
                 for i in range(rows.count())]  # fmt: skip
        assert [row[1] for row in table] == [name for name, _, _ in LINES]  # batch order
        assert [row[2] for row in table] == ["succeeded", "succeeded", "failed", "succeeded", "succeeded"]
        assert table[2][4].startswith("audio_not_found") and table[2][5] == "no audio"
        assert [row[3] for row in table if row[2] == "succeeded"] == [
            f"{np.ceil(50 * seconds) * 480 / SR:.2f} s" for _, seconds, _ in LINES if seconds]  # whole latent frames

        decoded = page.evaluate(DECODE_EVERY_SOURCE)
        assert len(decoded) == 4
        for item, (name, seconds, fmt) in zip(decoded, [line for line in LINES if line[1]]):
            assert item["status"] == 200 and item["type"] == "audio/wav", item
            assert name in item["label"] and item["rate"] == SR
            assert item["samples"] == item["stated"] == int(np.ceil(50 * seconds)) * 480, (name, item)
            assert item["statedSeconds"] == pytest.approx(item["samples"] / SR)
        players = page.evaluate(LOAD_EVERY_PLAYER)
        assert all(p.get("error") is None and p["duration"] == pytest.approx(p["stated"], abs=0.002)
                   for p in players), players

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "batch-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        print(f"batch page screenshot: {shot}")

        # Keyboard only: Tab reaches the skip link, then the toggle; Space presses it; the failed line comes first,
        # the URL says so, and the next Tab lands on the first player in the new order.
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.className") == "skip"
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.id") == "failed-first"
        page.keyboard.press("Space")
        assert page.get_attribute("#failed-first", "aria-pressed") == "true"
        assert rows.nth(0).get_attribute("data-status") == "failed" and "failed_first=1" in page.url
        assert page.inner_text("#order-note").startswith("Failed and canceled lines are listed first")
        page.keyboard.press("Tab")
        focused = page.evaluate("[document.activeElement.tagName, document.activeElement.getAttribute('aria-label')]")
        assert focused[0] == "AUDIO" and "intro" in focused[1], focused
        page.screenshot(path=str(ARTIFACTS / "batch-page-failed-first.png"), full_page=True)

        # The server orders the same way when the link asks for it.
        page.goto(url + "&failed_first=1")
        assert rows.nth(0).get_attribute("data-status") == "failed"
        assert page.get_attribute("#failed-first", "aria-pressed") == "true"
    finally:
        page.close()


def test_only_a_valid_link_or_the_owners_key_opens_the_page(svc, batch_id) -> None:
    with svc.client() as http:
        link = http.get(f"/v1/batches/{batch_id}/link", params={"expires_in": 120}).json()
        assert link["expires_at"] - time.time() == pytest.approx(120, abs=5)
        assert svc.client(KEY_B).get(f"/v1/batches/{batch_id}/link").status_code == 404
    path = link["path"]
    plain = httpx.Client(base_url=svc.url, timeout=30)
    assert plain.get(path).status_code == 200
    bare = plain.get(f"/batches/{batch_id}")
    assert bare.status_code == 401 and "signed link" in bare.json()["error"]["message"]
    tampered = plain.get(path[:-2] + ("AA" if not path.endswith("AA") else "BB"))
    assert tampered.status_code == 401 and "signature" in tampered.json()["error"]["message"]
    other = plain.get(path.replace(batch_id, "0" * 32))  # a signature is for one batch only
    assert other.status_code == 401
    settings = Settings.from_env({"AUK_API_KEYS": f"{KEY_A},{KEY_B},{KEY_C}"})
    exp, sig = LinkSigner(settings).sign(batch_id, 60, now=time.time() - 3600)
    expired = plain.get(f"/batches/{batch_id}", params={"exp": exp, "sig": sig})
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]

    # The page's audio answers under the same signature only, and only for this batch's lines.
    html = plain.get(path).text
    sources = re.findall(r'src="([^"]+)"', html)
    assert len(sources) == 4 and all(s.startswith(f"/batches/{batch_id}/audio/") for s in sources)
    audio = plain.get(sources[0].replace("&amp;", "&"))
    assert audio.status_code == 200 and audio.content[:4] == b"RIFF"
    ranged = plain.get(sources[0].replace("&amp;", "&"), headers={"Range": "bytes=0-99"})
    assert ranged.status_code == 206 and len(ranged.content) == 100 and ranged.headers["content-range"].startswith(
        "bytes 0-99/")
    unsigned = plain.get(sources[0].split("?")[0])
    assert unsigned.status_code == 401

    # The owner's bearer key opens it too; another key's does not find it.
    assert svc.client(KEY_A).get(f"/batches/{batch_id}").status_code == 200
    assert svc.client(KEY_C).get(f"/batches/{batch_id}").status_code == 404
