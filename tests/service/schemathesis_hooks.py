"""schemathesis hooks for ``test_openapi.py`` (loaded through ``SCHEMATHESIS_HOOKS``): a JSONL batch body is sent
as the text it is generated as."""

from __future__ import annotations

import schemathesis

schemathesis.serializer.alias("application/x-ndjson", "text/plain")
