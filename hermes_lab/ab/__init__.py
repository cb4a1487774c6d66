"""The A/B test (stage 40): router and compare, always-valid statistics, plan, rollout, report, the ab-run stage."""
