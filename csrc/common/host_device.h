/*
 * host_device.h - internal: TM_HOST_DEVICE marks small inline helpers shared by the CPU (g++) and CUDA (nvcc)
 * kernels, so that both backends compute them with the same code.
 */
#ifndef TORNADO_MOE_HOST_DEVICE_H
#define TORNADO_MOE_HOST_DEVICE_H

#if defined(__CUDACC__)
#define TM_HOST_DEVICE __host__ __device__
#else
#define TM_HOST_DEVICE
#endif

#endif
