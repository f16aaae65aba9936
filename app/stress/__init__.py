"""Stress and faults: the reconfiguration storm, the fault injection it drives, and the prepared GPU check."""
