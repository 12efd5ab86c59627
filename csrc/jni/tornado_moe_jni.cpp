// tornado_moe_jni.cpp - the JNI shell of tornado-moe (Java class tornadomoe.runtime.NativeKernels).
//
// Thin by design: each native copies its Java arguments into the C ABI's types, calls one tm_* function
// (tornado_moe.h) and turns a negative tm_status into a tornadomoe.runtime.TornadoKernelException carrying
// tm_last_error(). Argument packing per kernel signature happens in Java (KernelArguments); there is no
// kernel logic and no per-kernel function here: every kernel goes through tm_invoke.
#include <jni.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "tornado_moe.h"

namespace {

jclass g_exception_class = nullptr;     // global ref to tornadomoe/runtime/TornadoKernelException
jmethodID g_exception_ctor = nullptr;   // TornadoKernelException(String, int)

constexpr const char* kExceptionClass = "tornadomoe/runtime/TornadoKernelException";

void* as_pointer(jlong handle) { return reinterpret_cast<void*>(static_cast<intptr_t>(handle)); }

// Throws TornadoKernelException(what + ": " + tm_last_error(), status), or a RuntimeException if the class
// cannot be found (only when the JNI library is used without the jar).
void throw_status(JNIEnv* env, int status, const char* what) {
  char message[2048];
  const char* detail = tm_last_error();
  std::snprintf(message, sizeof message, "%s failed (status %d): %s", what, status,
                (detail && *detail) ? detail : "no message");
  if (g_exception_class && g_exception_ctor) {
    jstring text = env->NewStringUTF(message);
    if (text) {
      jobject ex = env->NewObject(g_exception_class, g_exception_ctor, text, static_cast<jint>(status));
      if (ex) {
        env->Throw(static_cast<jthrowable>(ex));
        return;
      }
    }
    if (env->ExceptionCheck()) return;  // e.g. OutOfMemoryError while building the exception
  }
  jclass fallback = env->FindClass("java/lang/RuntimeException");
  if (fallback) env->ThrowNew(fallback, message);
}

void throw_illegal_argument(JNIEnv* env, const char* message) {
  jclass cls = env->FindClass("java/lang/IllegalArgumentException");
  if (cls) env->ThrowNew(cls, message);
}

// A NUL-free string from the C library, or null for a null pointer.
jstring to_java(JNIEnv* env, const char* s) { return s ? env->NewStringUTF(s) : nullptr; }

}  // namespace

extern "C" {

JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM* vm, void*) {
  JNIEnv* env = nullptr;
  if (vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_8) != JNI_OK) return JNI_ERR;
  // Resolved here, with the class loader that loads the library (the jar's), and cached: natives may later
  // run on threads whose context class loader cannot see the jar (e.g. threads attached by JPype).
  jclass local = env->FindClass(kExceptionClass);
  if (local) {
    g_exception_class = static_cast<jclass>(env->NewGlobalRef(local));
    g_exception_ctor = env->GetMethodID(local, "<init>", "(Ljava/lang/String;I)V");
    env->DeleteLocalRef(local);
  }
  if (env->ExceptionCheck()) env->ExceptionClear();  // fall back to RuntimeException in throw_status
  return JNI_VERSION_1_8;
}

JNIEXPORT void JNICALL JNI_OnUnload(JavaVM* vm, void*) {
  JNIEnv* env = nullptr;
  if (vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_8) == JNI_OK && g_exception_class) {
    env->DeleteGlobalRef(g_exception_class);
  }
  g_exception_class = nullptr;
  g_exception_ctor = nullptr;
}

JNIEXPORT jint JNICALL Java_tornadomoe_runtime_NativeKernels_kernelCount(JNIEnv*, jclass) {
  return tm_kernel_count();
}

JNIEXPORT jstring JNICALL Java_tornadomoe_runtime_NativeKernels_kernelName(JNIEnv* env, jclass, jint index) {
  const char* name = tm_kernel_name(index);
  if (!name) {
    throw_status(env, TM_ERR_UNKNOWN_KERNEL, "tm_kernel_name");
    return nullptr;
  }
  return to_java(env, name);
}

JNIEXPORT jstring JNICALL Java_tornadomoe_runtime_NativeKernels_kernelSignature(JNIEnv* env, jclass,
                                                                                  jint index) {
  const char* signature = tm_kernel_signature(index);
  if (!signature) {
    throw_status(env, TM_ERR_UNKNOWN_KERNEL, "tm_kernel_signature");
    return nullptr;
  }
  return to_java(env, signature);
}

JNIEXPORT void JNICALL Java_tornadomoe_runtime_NativeKernels_invoke(JNIEnv* env, jclass, jint kernel_index,
                                                                    jint device, jlongArray args, jlong stream) {
  if (!args) {
    throw_illegal_argument(env, "invoke: args is null");
    return;
  }
  const jsize n = env->GetArrayLength(args);
  // Kernels take at most ~16 arguments: a stack buffer avoids an allocation per launch.
  uint64_t stack_words[32];
  std::vector<uint64_t> heap_words;
  uint64_t* words = stack_words;
  if (n > 32) {
    heap_words.resize(static_cast<size_t>(n));
    words = heap_words.data();
  }
  static_assert(sizeof(jlong) == sizeof(uint64_t), "jlong must be 64 bits");
  env->GetLongArrayRegion(args, 0, n, reinterpret_cast<jlong*>(words));
  if (env->ExceptionCheck()) return;
  const int rc = tm_invoke(kernel_index, static_cast<tm_device>(device), words, static_cast<int>(n),
                           as_pointer(stream));
  if (rc != TM_OK) throw_status(env, rc, "tm_invoke");
}

JNIEXPORT void JNICALL Java_tornadomoe_runtime_NativeKernels_beginCapture(JNIEnv* env, jclass, jlong stream) {
  const int rc = tm_cuda_graph_begin_capture(as_pointer(stream));
  if (rc != TM_OK) throw_status(env, rc, "tm_cuda_graph_begin_capture");
}

JNIEXPORT jlong JNICALL Java_tornadomoe_runtime_NativeKernels_endCapture(JNIEnv* env, jclass, jlong stream) {
  void* exec = nullptr;
  const int rc = tm_cuda_graph_end_capture(as_pointer(stream), &exec);
  if (rc != TM_OK) {
    throw_status(env, rc, "tm_cuda_graph_end_capture");
    return 0;
  }
  return static_cast<jlong>(reinterpret_cast<intptr_t>(exec));
}

JNIEXPORT void JNICALL Java_tornadomoe_runtime_NativeKernels_launchGraph(JNIEnv* env, jclass, jlong graph_exec,
                                                                         jlong stream) {
  const int rc = tm_cuda_graph_launch(as_pointer(graph_exec), as_pointer(stream));
  if (rc != TM_OK) throw_status(env, rc, "tm_cuda_graph_launch");
}

JNIEXPORT void JNICALL Java_tornadomoe_runtime_NativeKernels_destroyGraph(JNIEnv* env, jclass, jlong graph_exec) {
  const int rc = tm_cuda_graph_destroy(as_pointer(graph_exec));
  if (rc != TM_OK) throw_status(env, rc, "tm_cuda_graph_destroy");
}

JNIEXPORT void JNICALL Java_tornadomoe_runtime_NativeKernels_synchronize(JNIEnv* env, jclass, jint device,
                                                                         jlong stream) {
  const int rc = tm_stream_synchronize(static_cast<tm_device>(device), as_pointer(stream));
  if (rc != TM_OK) throw_status(env, rc, "tm_stream_synchronize");
}

JNIEXPORT jboolean JNICALL Java_tornadomoe_runtime_NativeKernels_cudaCompiled(JNIEnv*, jclass) {
  return tm_cuda_compiled() ? JNI_TRUE : JNI_FALSE;
}

JNIEXPORT jint JNICALL Java_tornadomoe_runtime_NativeKernels_cudaDeviceCount(JNIEnv*, jclass) {
  return tm_cuda_device_count();
}

JNIEXPORT jstring JNICALL Java_tornadomoe_runtime_NativeKernels_version(JNIEnv* env, jclass) {
  return to_java(env, tm_version());
}

JNIEXPORT jlong JNICALL Java_tornadomoe_runtime_NativeKernels_addressOf(JNIEnv* env, jclass, jobject buffer) {
  void* address = buffer ? env->GetDirectBufferAddress(buffer) : nullptr;
  if (!address) {
    throw_illegal_argument(env, "addressOf: not a direct ByteBuffer (allocate it with ByteBuffer.allocateDirect)");
    return 0;
  }
  return static_cast<jlong>(reinterpret_cast<intptr_t>(address));
}

}  // extern "C"
