"""What the launchers share at run time: the operand normaliser (`operands`), the compile-only
switch, launch observers and launch stream (`launch_context`), the plan cache and the native
launch path."""
