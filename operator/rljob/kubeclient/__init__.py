"""The Kubernetes API client that the operator and the `kubectl rljob` plugin share: who the process is to
the API server (credentials.py) and HTTP to it (apiserver.py). It imports nothing of rljob and no metrics
library: the operator counts the calls through the hook it passes to `ApiServer` (controller/kube.py)."""
