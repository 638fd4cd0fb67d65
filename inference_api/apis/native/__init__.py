"""The native API (SPEC §4.1), as the original Falcon-40B inference API: its route and its request."""
