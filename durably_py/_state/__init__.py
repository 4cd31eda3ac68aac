"""What a run's log means once read: its history, the advisories it raises and its timeline."""
