"""The broker connection: kombu's Redis transport with two corrections a long-running solo worker needs.

**An acknowledgement that fails still frees its prefetch slot.** A worker consumes with prefetch 1 and late
acknowledgement: kombu's virtual ``QoS`` lets the channel ask Redis for the next message (``BRPOP``) only while
``len(_delivered) - len(_dirty) < prefetch_count`` (``can_consume``). The Redis ``QoS.ack`` and ``QoS.reject``
(``kombu/transport/redis.py``) first remove the delivery from the ``unacked`` hash and index in Redis, and only
then mark the tag dirty (``virtual.QoS.ack``). When Redis is gone at that moment (it dropped while a job was
rendering), the removal raises a ``ConnectionError``, the tag is never marked, and ``kombu.Message.ack_log_error``
/ ``reject_log_error`` (what Celery's ``Request`` calls) catch the error and only log ``Couldn't ack`` /
``Couldn't reject``. The channel is then at its prefetch limit for good: ``MultiChannelPoller.on_poll_start``
never sends ``BRPOP`` again, no socket of the lost connection is polled any more, so no connection error ever
reaches Celery's ``Consumer.start`` and it never reconnects. The worker idles forever while its heartbeat thread
goes on saying ready. (A worker that loses Redis while idle recovers because its pending ``BRPOP`` socket reads
EOF, which raises in the event loop and restarts the consumer.)

``ReleasingQoS`` marks the tag in every case and re-raises. The slot is free again, so the next loop iteration
sends ``BRPOP`` on the broken connection; that raises a connection error in the event loop, and Celery's consumer
does what it does for any lost connection: closes it, reconnects, and consumes again. The delivery itself is still
in Redis's ``unacked`` hash (if Redis kept its data), so it is redelivered after the visibility timeout and meets a
record that ended (acknowledged without work) or a job the reaper already sent again (``recovery.py``).

**Reconnection is retried every ``RECONNECT_MAX_S`` at most.** Celery's consumer reconnects through
``Connection.ensure_connection`` with kombu's default back-off (2, 4, 6, ... up to 30 s between attempts), so a
worker could find a Redis that came back 30 s late. ``BrokerConnection`` caps the interval, so a worker consumes
again within a couple of seconds of Redis answering.

**The fetch is atomic** (``fetch.py``): a message leaves its queue and enters the worker's unacknowledged set in
one Lua script, instead of kombu's ``BRPOP`` followed by a separate write, so no kill loses a message; a dead
worker's fetched messages go back to their queue within a reaper pass.

``make_celery`` installs these through Celery's own extension points: ``Celery(amqp=BrokerAMQP)`` makes every
broker connection a ``BrokerConnection``, which hands out these transport classes for the ``redis``, ``rediss``
and ``sentinel`` schemes (the URL, and a failover's ``switch``, still name the scheme).
"""

from __future__ import annotations

from celery.app.amqp import AMQP
from kombu import Connection
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from auk_worker.service.queues import fetch

RECONNECT_MAX_S = 2.0  # longest wait between two attempts to reach a broker that went away


class ReleasingQoS(kombu_redis.QoS):
    """Redis QoS whose ``ack`` and ``reject`` free the prefetch slot even when Redis cannot be told."""

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)
            raise

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)
            raise


class FetchingQoS(fetch.FetchingQoS, ReleasingQoS):
    pass


class Channel(fetch.FetchingChannel, kombu_redis.Channel):
    QoS = FetchingQoS
    from_transport_options = kombu_redis.Channel.from_transport_options + fetch.OPTIONS


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(fetch.FetchingChannel, kombu_redis.SentinelChannel):
    QoS = FetchingQoS
    from_transport_options = kombu_redis.SentinelChannel.from_transport_options + fetch.OPTIONS


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


TRANSPORTS = {"redis": Transport, "rediss": Transport, "sentinel": SentinelTransport}


def transport_path(url: str) -> str:
    """The transport class for ``url``'s scheme as Celery's ``broker_transport`` names it. ``Celery(amqp=...)``
    reaches the connections Celery makes itself, not the producer pool's (``kombu.connection.PooledConnection``);
    a transport named in the configuration reaches every connection, so publishers ring the wake lists too."""
    return f"{__name__}:{TRANSPORTS[url.split('://', 1)[0]].__name__}"


class BrokerConnection(Connection):
    """A kombu connection with the transports above and a capped reconnection back-off."""

    def get_transport_cls(self):
        return TRANSPORTS.get(self.transport_cls) or super().get_transport_cls()

    def _ensure_connection(self, errback=None, max_retries=None, interval_start=2, interval_step=2,
                           interval_max=30, *args, **kwargs):  # fmt: skip
        return super()._ensure_connection(errback, max_retries, min(interval_start, RECONNECT_MAX_S / 2),
                                          min(interval_step, RECONNECT_MAX_S / 2),
                                          min(interval_max, RECONNECT_MAX_S), *args, **kwargs)  # fmt: skip


class BrokerAMQP(AMQP):
    Connection = BrokerConnection
