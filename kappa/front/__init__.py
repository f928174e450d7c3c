"""Front ends: the ``kappa`` command line (``cli``), analyst queries over the serving versions (``query``: DuckDB +
delta-rs, or Spark SQL), the local stack of ``make run`` (``stack``), the local Airflow's REST API
(``airflow_client``; ``airflow_tasks``: the one-line failure reason the DAGs' tasks record for it) and the
benchmark with its peer (``bench``, ``peer``, ``peer_app``)."""

from kappa import lazy_exports

__all__ = ["analyst_spark", "run_query"]

__getattr__ = lazy_exports(__name__, {
    "analyst_spark": "kappa.front.query",
    "run_query": "kappa.front.query",
})
