"""What the tests share and are not tests themselves: a backend factory and `wait_for`, servers and
clusters they start, users' own pipelines they run, oracles that recompute the expected output,
drivers a test runs in a process of its own, and the interleaving checker."""
