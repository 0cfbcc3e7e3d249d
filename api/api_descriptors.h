/* api_descriptors.h - the FileDescriptorSet of every proto moetraind serves
 * (moetrain.proto, grpc health, reflection v1 and v1alpha, with imports),
 * produced by protoc at build time and embedded for server reflection. */
#ifndef MT_API_DESCRIPTORS_H
#define MT_API_DESCRIPTORS_H

extern const unsigned char mt_api_descriptor_set[];
extern const unsigned long mt_api_descriptor_set_len;

#endif
