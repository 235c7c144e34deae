"""Helpers to run the P/D deployment (vLLM servers, proxy, Mooncake master) and talk to it."""
