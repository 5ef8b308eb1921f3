"""The search over optimization toggles: space, study, statistics, decisions."""
