"""The mistake checks: ranks running collectives in different orders, ranks holding different weights, an optimizer built before fully_shard."""
