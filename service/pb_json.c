/* pb_json.c - see pb_json.h. */
#include "service/pb_json.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static void camel(const char *name, char *out, size_t cap)
{
    size_t o = 0;
    int up = 0;
    for (const char *s = name; *s && o + 1 < cap; s++) {
        if (*s == '_') {
            up = 1;
            continue;
        }
        out[o++] = up ? (char)toupper((unsigned char)*s) : *s;
        up = 0;
    }
    out[o] = '\0';
}

static json_t *number(double v)
{
    if (isnan(v)) return json_string("NaN");
    if (isinf(v)) return json_string(v > 0 ? "Infinity" : "-Infinity");
    return json_real(v);
}

static json_t *i64(long long v)
{
    char b[32];
    snprintf(b, sizeof b, "%lld", v);
    return json_string(b);
}

static json_t *u64(unsigned long long v)
{
    char b[32];
    snprintf(b, sizeof b, "%llu", v);
    return json_string(b);
}

static json_t *scalar(const ProtobufCFieldDescriptor *f, const void *p)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32: return json_integer(*(const int32_t *)p);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32: return json_integer(*(const uint32_t *)p);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64: return i64(*(const int64_t *)p);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64: return u64(*(const uint64_t *)p);
    case PROTOBUF_C_TYPE_FLOAT: return number(*(const float *)p);
    case PROTOBUF_C_TYPE_DOUBLE: return number(*(const double *)p);
    case PROTOBUF_C_TYPE_BOOL: return json_boolean(*(const protobuf_c_boolean *)p);
    case PROTOBUF_C_TYPE_ENUM: {
        const ProtobufCEnumValue *ev =
            protobuf_c_enum_descriptor_get_value(f->descriptor, *(const int *)p);
        return ev ? json_string(ev->name) : json_integer(*(const int *)p);
    }
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        return json_string(s ? s : "");
    }
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *b = p;
        return json_stringn((const char *)b->data, b->len);
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *m = *(ProtobufCMessage *const *)p;
        return m ? pb_to_json(m) : json_null();
    }
    }
    return json_null();
}

static size_t elem_size(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64: return 8;
    case PROTOBUF_C_TYPE_DOUBLE: return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE: return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
    default: return 4;
    }
}

json_t *pb_to_json(const ProtobufCMessage *m)
{
    json_t *o = json_object();
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *base = (const char *)m;
        char key[128];
        camel(f->name, key, sizeof key);
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t which = *(const uint32_t *)(base + f->quantifier_offset);
            if (which != f->id) continue;
            json_object_set_new(o, key, scalar(f, base + f->offset));
        } else if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            const char *arr = *(const char *const *)(base + f->offset);
            json_t *a = json_array();
            for (size_t k = 0; k < n; k++)
                json_array_append_new(a, scalar(f, arr + k * elem_size(f->type)));
            json_object_set_new(o, key, a);
        } else {
            json_object_set_new(o, key, scalar(f, base + f->offset));
        }
    }
    return o;
}
