"""The closed loop on a local cluster: traffic shifts, the operator retunes, a timeline shows it."""
