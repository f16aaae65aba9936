"""What-if: the policy lab, the what-if checks against real reruns, their CLI, and the window tab's worker."""
