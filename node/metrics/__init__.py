"""Prometheus metrics on every node: `registry` (the node's registry, filled at scrape
time from the counters the roles keep), `worker` and `trainer` (what each role exposes), `server`
(the --metrics-port: /metrics, /healthz, /readyz) and `push` (--metrics-push, for nodes nobody can
scrape). The catalogue, with every name, type and label, is in docs/operations.md, 'Metrics'."""
