"""The protobuf messages the Tinker SDK speaks where JSON would be too slow: the body of
`forward_backward` and the results of forward/backward and sampling (package `tinker_public`).
Built from a descriptor here, field for field as the SDK's own (tinker 0.38), so rlexp needs no
generated code and no import of the SDK. Token ids travel as little-endian int32 bytes, tensors
as raw little-endian float32 / int64 bytes."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
DOUBLE, INT64, INT32, BOOL, STRING, MESSAGE, BYTES, UINT32, ENUM = (
    F.TYPE_DOUBLE, F.TYPE_INT64, F.TYPE_INT32, F.TYPE_BOOL, F.TYPE_STRING, F.TYPE_MESSAGE, F.TYPE_BYTES,
    F.TYPE_UINT32, F.TYPE_ENUM)
REPEATED = "repeated"

# message -> fields (name, number, type, type name or None, REPEATED / a oneof's name / None);
# a type name "map<K,V>" makes a map field (K string, V a scalar type or a message)
MESSAGES: dict[str, list[tuple]] = {
    "Tensor": [("dense", 1, BYTES, None, "encoding"), ("sparse_csr", 2, MESSAGE, "SparseCsr", "encoding"),
               ("dtype", 3, ENUM, "DType", None), ("shape", 4, INT64, None, REPEATED)],
    "SparseCsr": [("values", 1, BYTES, None, None), ("crow_indices", 2, BYTES, None, None),
                  ("col_indices", 3, BYTES, None, None)],
    "BatchedTensor": [("data", 1, BYTES, None, None), ("offsets", 2, BYTES, None, None),
                      ("dtype", 3, ENUM, "DType", None), ("trailing_shape", 4, INT64, None, REPEATED)],
    "ArrayRecord": [("type_tag", 1, STRING, None, None),
                    ("fields", 2, MESSAGE, "map<string,BatchedTensor>", None),
                    ("num_datums", 3, INT64, None, None)],
    "ForwardBackwardOutput": [("loss_fn_output_type", 1, STRING, None, None),
                              ("loss_fn_outputs", 2, MESSAGE, "ArrayRecord", REPEATED),
                              ("metrics", 3, MESSAGE, "map<string,double>", None)],
    "LossConfigValue": [("number", 1, DOUBLE, None, "value"), ("text", 2, STRING, None, "value")],
    "ForwardBackwardRequest": [
        ("model_id", 1, STRING, None, None), ("seq_id", 2, INT32, None, None),
        ("data", 3, MESSAGE, "Datum", REPEATED), ("loss_fn", 4, STRING, None, None),
        ("loss_fn_config", 5, MESSAGE, "map<string,double>", None), ("forward_only", 6, BOOL, None, None),
        ("loss_fn_config_v2", 7, MESSAGE, "map<string,LossConfigValue>", None)],
    "Datum": [("model_input", 1, MESSAGE, "Chunk", REPEATED),
              ("loss_fn_inputs", 2, MESSAGE, "map<string,Tensor>", None),
              ("model_input_spans", 3, MESSAGE, "ProvenanceSpan", REPEATED),
              ("loss_fn_input_spans", 4, MESSAGE, "ProvenanceSpan", REPEATED)],
    "ProvenanceSpan": [("prompt_tokens", 1, MESSAGE, "Span", "span"),
                       ("sampled_tokens", 2, MESSAGE, "Span", "span")],
    "Span": [("sequence_id", 1, STRING, None, None), ("offset", 2, INT64, None, None),
             ("length", 3, INT64, None, None)],
    "Chunk": [("encoded_text", 1, MESSAGE, "EncodedTextChunk", "chunk"),
              ("image", 2, MESSAGE, "Opaque", "chunk"),
              ("dmel", 3, MESSAGE, "Opaque", "chunk")],
    "EncodedTextChunk": [("tokens", 1, BYTES, None, None)],
    "Opaque": [],  # a chunk kind rlexp does not serve (image, dmel): refused by its kind
    "SampleResponse": [("sequences", 1, MESSAGE, "SampledSequence", REPEATED),
                       ("prompt_logprobs", 2, BYTES, None, None),
                       ("topk_prompt_logprobs", 3, MESSAGE, "TopkLogprobs", None),
                       ("prompt_cache_hit_tokens", 4, INT32, None, None)],
    "SampledSequence": [("stop_reason", 1, ENUM, "StopReason", None), ("tokens", 2, BYTES, None, None),
                        ("logprobs", 3, BYTES, None, None),
                        ("topk_sampled_logprobs", 4, MESSAGE, "TopkLogprobs", None)],
    "TopkLogprobs": [("token_ids", 1, BYTES, None, None), ("logprobs", 2, BYTES, None, None),
                     ("k", 3, UINT32, None, None), ("length", 4, UINT32, None, None)],
}
ENUMS = {"StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
         "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"]}
SCALARS = {"double": DOUBLE, "string": STRING}
PACKAGE = "tinker_public"


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="rlexp_tinker_public.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        f.enum_type.add(name=name).value.extend(
            descriptor_pb2.EnumValueDescriptorProto(name=v, number=i) for i, v in enumerate(values))
    for name, fields in MESSAGES.items():
        m = f.message_type.add(name=name)
        oneofs: list[str] = []
        for field, number, kind, type_name, how in fields:
            d = m.field.add(name=field, number=number, type=kind,
                            label=F.LABEL_REPEATED if how == REPEATED else F.LABEL_OPTIONAL)
            if type_name and type_name.startswith("map<"):
                entry = _map_entry(m, field, type_name)
                d.label, d.type_name = F.LABEL_REPEATED, f".{PACKAGE}.{name}.{entry}"
            elif type_name:
                d.type_name = f".{PACKAGE}.{type_name}"
            if how not in (None, REPEATED):
                if how not in oneofs:
                    oneofs.append(how)
                    m.oneof_decl.add(name=how)
                d.oneof_index = oneofs.index(how)
    return f


def _map_entry(m: descriptor_pb2.DescriptorProto, field: str, spec: str) -> str:
    key, value = spec[4:-1].split(",")
    entry = m.nested_type.add(name="".join(p.title() for p in field.split("_")) + "Entry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=SCALARS[key], label=F.LABEL_OPTIONAL)
    v = entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL)
    if value in SCALARS:
        v.type = SCALARS[value]
    else:
        v.type, v.type_name = MESSAGE, f".{PACKAGE}.{value}"
    return entry.name


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())
_classes = message_factory.GetMessages([_file()], pool=_pool)

ForwardBackwardRequest = _classes[f"{PACKAGE}.ForwardBackwardRequest"]
ForwardBackwardOutput = _classes[f"{PACKAGE}.ForwardBackwardOutput"]
SampleResponse = _classes[f"{PACKAGE}.SampleResponse"]
SampledSequence = _classes[f"{PACKAGE}.SampledSequence"]
TopkLogprobs = _classes[f"{PACKAGE}.TopkLogprobs"]
BatchedTensor = _classes[f"{PACKAGE}.BatchedTensor"]
DTYPE_FLOAT32, DTYPE_INT64 = 1, 2
STOP, LENGTH = 0, 1


def forward_output(logprobs: list, metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord with the per-datum `logprobs` (float32 arrays,
    in the datums' order) and the metrics."""
    import numpy as np

    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    record = out.loss_fn_outputs.add(num_datums=len(logprobs))
    arrays = [np.ascontiguousarray(a, "<f4") for a in logprobs]
    offsets = np.zeros(len(arrays) + 1, "<i8")
    np.cumsum([a.nbytes for a in arrays], out=offsets[1:])
    record.fields["logprobs"].CopyFrom(BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                     offsets=offsets.tobytes(), dtype=DTYPE_FLOAT32))
    return out.SerializeToString()
