"""The run's relays: public libp2p nodes the run owner runs so that contributors behind NAT can
serve (`agora-node --role relay`, node/relay_cli.py)."""
