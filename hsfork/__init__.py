"""Tooling for the vllm-hybrid-spec fork: upstream pin, patch series, wheel, bundle."""
