"""The test suite. Set here, before any test module or conftest imports torch: two pytest
workers share the machine, and libgomp's threads spin for a while after each parallel region
by default, burning the cores the other worker's processes (engines, trainers, runs) need.
PASSIVE makes them sleep at once. Thread counts are unchanged, and with them every number a
test compares (the fingerprint and tiny-model references hold). Measured in docs/install.md."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
