"""View-job runners: local processes (``local``) and Kubernetes workloads (``kubernetes``)."""
