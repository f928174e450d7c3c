"""View logic: one module per view version (``jobs/<view>/v<N>.py``), each exposing ``VIEW``.

A version is a pure transform plus its declarations (:class:`kappa.runtime.view.ViewDefinition`). To change business
logic, add ``v<N+1>.py`` next to the old one and register it in ``kappa/platform.yaml``; never edit a version
that has run, since its table and checkpoint belong to that code.

Run one with ``kappa view run <view> --version <N>`` (or ``python -m jobs <view> --version <N>``).
"""
