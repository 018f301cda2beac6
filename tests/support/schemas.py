"""JSON Schemas the structured-output tests ask replies to follow: enums, number ranges, arrays with min and max
items, nested objects, no unlisted keys (issue 29's list)."""

SCHEMAS = {
    "enums and ranges": {
        "type": "object", "additionalProperties": False, "required": ["size", "layers", "ratio"],
        "properties": {"size": {"enum": ["small", "medium", "large"]},
                       "layers": {"type": "integer", "minimum": 1, "maximum": 80},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}}},
    "arrays with min and max items": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 3,
                                "items": {"type": "string", "maxLength": 12}}}},
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["model", "plan"],
        "properties": {"model": {"type": "string", "maxLength": 20},
                       "plan": {"type": "object", "additionalProperties": False, "required": ["fits", "devices"],
                                "properties": {"fits": {"type": "boolean"},
                                               "devices": {"type": "array", "maxItems": 2, "items": {
                                                   "type": "object", "additionalProperties": False,
                                                   "required": ["name", "gib"],
                                                   "properties": {"name": {"enum": ["cpu", "cuda:0"]},
                                                                  "gib": {"type": "integer", "minimum": 0,
                                                                          "maximum": 64}}}}}}}},
}
