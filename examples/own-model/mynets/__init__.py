"""A user's own model package: nothing here is part of Kiln, and Kiln's registry does not know it."""
