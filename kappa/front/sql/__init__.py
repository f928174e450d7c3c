"""The analysts' SQL service: JDBC (HiveServer2 protocol) and Spark Connect over the serving views, read-only.

:mod:`kappa.front.sql.server` runs it; ``java/`` holds its guards (compiled by ``make setup`` into
``.cache/jars/sql/kappa-sql.jar``).
"""
