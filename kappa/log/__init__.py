"""The retained log: the local KRaft broker (``broker``), topics declared in ``platform.yaml`` and converged with
the AdminClient (``topics``), the versioned event schemas (``schemas``), the event generator (``generator``)."""

from kappa import lazy_exports

__all__ = ["LocalBroker", "TopicError", "declared_topics", "ensure_topics", "offsets_for_timestamp",
           "partition_offsets"]

__getattr__ = lazy_exports(__name__, {
    "LocalBroker": "kappa.log.broker",
    "TopicError": "kappa.log.topics",
    "declared_topics": "kappa.log.topics",
    "ensure_topics": "kappa.log.topics",
    "offsets_for_timestamp": "kappa.log.topics",
    "partition_offsets": "kappa.log.topics",
})
