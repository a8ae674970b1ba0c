"""The collective proof: every rank issues the same collectives, shown before launch by a dry
run of the real trainer on the fake process group."""
