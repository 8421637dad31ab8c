"""What the launchers share at run time: the plan cache and the native launch path."""
