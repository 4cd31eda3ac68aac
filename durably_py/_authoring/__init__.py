"""What a workflow sees: the context, workflows, policies, resources, results, schemas, graphs and handles."""
