"""The AuK render service's Python client: ``Client`` and the typed results it returns.

    from auk_client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as auk:
        auk.speech('Say the following: "Hello."', duration_seconds=2.0).save("hello.wav")

Depends on httpx only (no torch, no service code); see ``auk_client.client`` for every method.
"""

from auk_client.client import ApiError, Client
from auk_client.types import Batch, ErrorInfo, Job, JobResult, Manifest, Speech, Upload, Voice

__all__ = ["ApiError", "Batch", "Client", "ErrorInfo", "Job", "JobResult", "Manifest", "Speech", "Upload", "Voice"]
