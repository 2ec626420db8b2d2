"""Other projects' own test files run unchanged against bubblesnap (not part of ``make
test``: they need the other project's source tree)."""
