"""The health monitor [report 3.6.2]: a node that trains nothing, reads the DHT every interval and
keeps the run's history (membership, stages, training progress, averaging health, alerts) in the
authorizer's database. It runs inside the authorizer by default; `agora-node --role monitor` runs
it alone."""
