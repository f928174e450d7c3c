"""kappa -- a Kappa-architecture reference platform.

Kafka is the retained log; Spark Structured Streaming jobs (``jobs/``) maintain Delta Lake views from it.
Import the submodules you need (``kappa.config``, ``kappa.catalog``, ``kappa.topics``, ``kappa.broker``,
``kappa.schemas``, ``kappa.generator``, ...); this package module deliberately imports nothing heavy.
"""

__all__: list[str] = []
