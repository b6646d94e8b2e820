"""Webhooks in the Standard Webhooks scheme, read in the order a delivery meets them: ``signing.py`` (the signature
scheme and the event body), ``store.py`` (per-owner secrets and durable deliveries in Redis) and ``dispatch.py``
(the dispatcher that sends them, and its command line).

- **Signing** (standard-webhooks/standard-webhooks ``spec/standard-webhooks.md``): a secret is ``whsec_`` + base64
  of random bytes; a request carries ``webhook-id`` (the delivery's id, the same on every retry),
  ``webhook-timestamp`` (integer seconds of this attempt) and ``webhook-signature``: ``v1,<base64 HMAC-SHA256 of
  "{id}.{timestamp}.{body}">``, space-separated when signed with several secrets (a rotation's grace period).
  ``verify`` is the receiver's side, with a timestamp tolerance against replays.
- **WebhookSecrets**: one secret per owner (API key), created on first use, rotatable; the previous one keeps
  signing beside the new one for a grace period, so receivers can switch without losing a delivery.
- **WebhookStore**: a delivery is a Redis hash, written with its entry in a sorted set of due deliveries in one
  script, so a crash loses none. Times are Redis server time, so dispatchers on hosts with skewed clocks agree.
- **WebhookDispatcher**: threads that claim one due delivery at a time (a Lua script: it moves the delivery's due
  time forward by a lease and counts the attempt, so no other dispatcher sends that attempt while the lease runs),
  re-check the URL with the guard (DNS may have changed since the job was submitted), POST the stored body to the
  checked address, and record the outcome; only the lease holder's outcome is written. A non-2xx answer, a timeout
  or a connection error is retried after ``draw * min(cap, base * 2 ** (attempts - 1))`` seconds (exponential
  backoff with full jitter, ``draw`` uniform in [0, 1)), or later if the receiver sent ``Retry-After``, until
  ``max_attempts`` or ``max_age_s``; then the delivery is ``failed``. ``410 Gone`` and a URL the guard now refuses
  fail it at once. Delivery is at least once: a request that outlives its lease may overlap a retry, which is why
  receivers deduplicate by ``webhook-id``, as the spec says.

Keys (namespace ``auk``): ``auk:webhook:{id}`` (hash), ``auk:webhooks:due`` (zset: id by due time, or by lease expiry
while in flight), ``auk:webhook_secret:{owner}`` (hash: current, previous, previous_until).

Run standalone with ``python -m auk_worker.service.delivery.webhooks``; inside another process,
``WebhookDispatcher.start()``.
"""
